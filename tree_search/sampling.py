"""Temperature / top-k / top-p processing shared by draft and target, and host-sync-free sampling helpers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-3  # below this, refused: see SamplingParams


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 = greedy (argmax); a positive one is at least
    MIN_TEMPERATURE, as logits / T overflow float32 below it (colder sampling is greedy decoding in all but exactness).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            hint = " (use 0 for greedy decoding)" if isinstance(t, (int, float)) and 0 < t < MIN_TEMPERATURE else ""
            raise ValueError("temperature must be a number >= 0: 0 for greedy, else finite and "
                             f">= {MIN_TEMPERATURE:g}; got {t!r}{hint}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# transformers' values for generation_config fields a model leaves unset (GenerationConfig._get_default_generation_params)
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

# generation_config fields that make `target.generate` process logits (or search) in ways tree_search does not
# reproduce: name -> (is it on?, the value that turns it off). Checked only when set (not None). Penalties, n-gram
# and word bans, suppressed tokens and minimum lengths are applied (`tree_search.processors`).
_SET = (lambda v: True, "None")  # on whenever set
_NON_EMPTY = (bool, "None")
_ALWAYS = {
    **dict.fromkeys(("forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty"), _SET),
    "guidance_scale": (lambda v: v != 1, "1.0"),
    "num_beams": (lambda v: v > 1, "1"),
    **dict.fromkeys(("constraints", "force_words_ids", "stop_strings"), _NON_EMPTY),
    "watermarking_config": _SET,
}
_GREEDY_ONLY = {"penalty_alpha": (lambda v: v > 0, "None")}  # contrastive search replaces greedy search
_SAMPLING_ONLY = {  # warpers transformers applies only when sampling
    "min_p": (lambda v: v > 0, "None"),
    "typical_p": (lambda v: v < 1, "1.0"),
    "epsilon_cutoff": (lambda v: 0 < v < 1, "0.0"),
    "eta_cutoff": (lambda v: 0 < v < 1, "0.0"),
    "top_h": _SET,
}


def check_generation_config(config, params: SamplingParams) -> None:
    """Refuse a generation_config that sets a logits processor or search mode tree_search does not apply, so the
    output never silently differs from `target.generate`'s (one line naming the setting and how to drop it)."""
    if config is None:
        return
    checks = {**_ALWAYS, **(_GREEDY_ONLY if params.greedy else _SAMPLING_ONLY)}
    for name, (active, off) in checks.items():
        value = getattr(config, name, None)
        if value is not None and active(value):
            raise ValueError(f"the target's generation_config sets {name} = {value!r}, which tree_search does not "
                             f"apply; set target.generation_config.{name} = {off} (or drop it from "
                             "generation_config.json) to decode without it")


def resolve_sampling(target=None, temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None) -> SamplingParams:
    """The sampling `target.generate(...)` would do: explicit values win, None takes the target's generation_config
    (temperature None: greedy unless it sets do_sample), unset fields there take transformers' defaults. Explicit
    values are validated even where greedy decoding ignores them; other processors are refused
    (`check_generation_config`).
    """
    explicit = SamplingParams(0.0 if temperature is None else temperature, 0 if top_k is None else top_k,
                              1.0 if top_p is None else top_p)
    config = getattr(target, "generation_config", None)

    def default(name):
        value = getattr(config, name, None)
        return HF_DEFAULTS[name] if value is None else value

    if temperature is None:
        temperature = default("temperature") if default("do_sample") else 0.0
    if temperature == 0:  # greedy: top-k / top-p do not change the argmax
        params = SamplingParams(0.0, explicit.top_k, explicit.top_p)
    else:
        params = SamplingParams(float(temperature), int(default("top_k") if top_k is None else top_k),
                                float(default("top_p") if top_p is None else top_p))
    check_generation_config(config, params)
    return params


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution (..., V) in float32: one-hot argmax when greedy, else softmax(logits / T)
    restricted to the top-k tokens and then to the smallest top-p nucleus (HF warper order)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the top token always stays (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def soft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits_to_probs`, but a plain softmax (temperature 1) when greedy, where that one is one-hot: the
    distribution a greedy draft is recorded and judged by."""
    return logits_to_probs(logits, params if not params.greedy else SamplingParams(temperature=1.0))


def exponential_noise(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """Exp(1) noise shaped like `probs` (..., V): from one generator (None: torch's global RNG), or from B generators,
    generator b filling batch row b's block of rows, as that prompt alone would draw it."""
    noise = torch.empty_like(probs)
    if generator is None or isinstance(generator, torch.Generator):
        return noise.exponential_(generator=generator)
    for rows, row_generator in zip(noise.view(len(generator), -1, probs.shape[-1]), generator):
        rows.exponential_(generator=row_generator)
    return noise


def keyed_choice(probs: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """The token a seeded request samples at its position-th new token from each row of `probs` (..., V) (rows
    continuing the same sequence to that position: a tree level's nodes): argmax(p / E), E Exp(1) noise drawn from
    (seed, position) alone, whatever else runs beside the request and however its tokens were proposed."""
    generator = torch.Generator(device=probs.device).manual_seed(hash((seed, position)) & (2**63 - 1))
    noise = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def sample(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of `probs` (..., V) -> (...,), via argmax(p / Exp(1)): exact and no host sync."""
    return (probs / exponential_noise(probs, generator)).argmax(-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator=None) -> torch.Tensor:
    """The token after each row of `logits` (..., V): the argmax when greedy, else one draw from the processed
    distribution (`generator` as `exponential_noise` takes it)."""
    return logits.argmax(-1) if params.greedy else sample(logits_to_probs(logits, params), generator)


def sample_without_replacement(probs: torch.Tensor, n: int, generator=None) -> torch.Tensor:
    """n distinct draws per row, in draw order, without replacement: ranking p / E, E ~ Exp(1), is the Plackett–Luce
    order. Rows with fewer than n supported tokens are padded with zero-probability tokens, which verifiers must skip
    (they were never drawn)."""
    return torch.topk(probs / exponential_noise(probs, generator), n, dim=-1).indices
