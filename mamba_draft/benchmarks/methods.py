"""Decoding methods a benchmark compares, parsed from strings like `default`, `3,2,2,1,1@fly` or `verifier=fly`.

    hf-ar            transformers `generate` (greedy or sampling), the target alone
    hf-assisted      transformers assisted generation with a Transformer assistant (`--assistant`)
    hf-lookup        transformers prompt-lookup decoding (`prompt_lookup_num_tokens`), the target alone
                     (hf-* methods run on plain copies of the models, `load_plain`: what a user has without us)
    llama-cpp        llama.cpp on the target's own GGUF file (`mamba_draft/benchmarks/llama_cpp.py`; the `llama-cpp` extra)
    ar               our harness, one target forward per token (tree_search.generate_autoregressive)
    default          a method, not a policy: what `generate` runs with its defaults on the target's device (policy
                     `auto`, the prompt-lookup rounds `plan.default_lookup_tokens` gives it, and generate's own
                     verifier for the temperature)
    <policy>         drafting with the drafter under a tree policy of `generate`'s grammar, parsed by
                     tree_search.policy.parse_policy alone: auto, none, a shape like 3,2,2,1,1, chain:N,
                     bandit[:A/B/...] or bandit-time[:A/B/...] (no lookup rounds, greedy verification)
    <drafting>+lookup[:K]  also prompt-lookup rounds of <= K tokens (default 8; `generate(lookup_tokens=K)`);
                     `none+lookup` is prompt-lookup decoding alone in our harness
    <drafting>@V     any drafting method (`default` or a policy) verified by verifier V (default `greedy`, lossless)
    assistant:<drafting>  the same, drafted by the `--assistant` Transformer in our engine (`TransformerDrafter`)
    verifier=V       shorthand for `bandit@V`
    LABEL=METHOD     any of the above, shown as LABEL in tables and plots
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from tree_search.plan import LOOKUP_TOKENS

HF_KINDS = ("hf-ar", "hf-assisted", "hf-lookup")
LLAMA_CPP = "llama-cpp"  # llama.cpp on the target's GGUF: another implementation, its agreement with `ar` reported
METHOD_GRAMMAR = ("hf-ar, hf-assisted, hf-lookup, llama-cpp, ar, default or a tree policy (with an optional assistant: "
                  "prefix, +lookup[:K] and @verifier), verifier=NAME or LABEL=METHOD")


@dataclass(frozen=True)
class Method:
    name: str                 # the spec as given (table label)
    kind: str                 # hf-ar | hf-assisted | hf-lookup | llama-cpp | ar | spec
    tree: str = ""            # spec: its tree policy (tree_search.policy grammar): "auto", "1,1,1,1,1", "bandit:..."
    # None (`default`): generate's own choice, greedy at temperature 0, else sampling (both lossless)
    verifier: str | None = "greedy"
    # spec: the longest prompt-lookup proposal a round verifies (0: none; None: generate's default for the tree,
    # device and batch, `plan.default_lookup_tokens`)
    lookup: int | None = 0
    drafter: str = "drafter"  # spec: which model drafts: the drafter (--drafter) or the assistant (--assistant)

    @property
    def baseline(self) -> str:
        """The autoregressive method of the same harness (bench.resolve_methods adds it when missing)."""
        return "hf-ar" if self.kind in HF_KINDS else "ar"

    @property
    def lossless(self) -> bool:
        if self.kind != "spec":
            return True
        from tree_search import get_verifier

        return get_verifier(self.verifier or "greedy").lossless


def parse_method(spec: str) -> Method:
    """Parse and validate one method string (unknown verifiers and bad tree policies raise ValueError). The policy is
    checked here and resolved per pass by `parse_policy`, which `Pass` calls with persistent=True under
    `--bandit-memory pass`: `default` then learns over the pass as a `SpeculativeDecoder` learns over its calls, and
    otherwise restarts per call as the one-call `generate` function does."""
    from tree_search import available_verifiers
    from tree_search.policy import parse_policy, spec_of

    name = spec.strip()
    label, sep, rest = name.partition("=")
    if sep and label != "verifier":
        if not label or not rest:
            raise ValueError(f"method {spec!r}: expected LABEL=METHOD")
        return replace(parse_method(rest), name=label)
    if name in (*HF_KINDS, LLAMA_CPP, "ar"):
        return Method(name, name)
    drafter = "assistant" if name.startswith("assistant:") else "drafter"
    body = name.removeprefix("assistant:")
    if body.startswith("verifier="):
        body = "bandit@" + body.removeprefix("verifier=")
    drafting, _, verifier = body.partition("@")
    drafting, with_lookup, lookup_arg = drafting.partition("+lookup")
    default = drafting == "default"  # generate's defaults: its verifier (None) and lookup rounds (None)
    verifier, lookup = verifier or (None if default else "greedy"), None if default else 0
    if with_lookup:
        lookup = LOOKUP_TOKENS if not lookup_arg else int(lookup_arg[1:]) if lookup_arg[1:].isdigit() else -1
        if not 1 <= lookup <= 64 or (lookup_arg and not lookup_arg.startswith(":")):
            raise ValueError(f"method {spec!r}: +lookup takes a proposal length in [1, 64], e.g. +lookup:8")
    for part in (verifier or "greedy").split("+"):
        if part not in available_verifiers():
            raise ValueError(f"method {spec!r}: unknown verifier {part!r}; available: {', '.join(available_verifiers())}")
    try:
        tree = spec_of(parse_policy("auto" if default else drafting))
    except ValueError as err:
        raise ValueError(f"unknown method {spec!r}: {err}; a method is {METHOD_GRAMMAR}") from None
    return Method(name, "spec", tree, verifier, lookup, drafter)


def lookup_of(method: Method, device: str | torch.device, batch: bool) -> int:
    """The prompt-lookup proposal length `method` runs with: its own, or for `default` what `generate` resolves for
    tree "auto" on this device (`plan.default_lookup_tokens`; generate cannot resolve it here, as the bench hands
    it a policy object rather than "auto")."""
    from tree_search.plan import default_lookup_tokens

    return method.lookup if method.lookup is not None else default_lookup_tokens(method.tree, device, batch,
                                                                                 prompt_lookup=False)


def load_plain(path, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """A causal LM as a user loads it without us, for transformers' own `generate` (the hf-* methods): its dtype,
    transformers' default attention, no prepacked weights, no row blocks."""
    from mamba_draft.targets import load_causal_lm

    return load_causal_lm(path, dtype=dtype, device=device, attn_implementation=None, pack=False, row_blocks=False)


@dataclass
class Models:
    target: torch.nn.Module           # ours: loaded with load_causal_lm's defaults (exact forwards on every CPU)
    drafter: object = None
    assistant: torch.nn.Module | None = None  # ours: drafts the assistant: methods
    tokenizer: object = None
    assistant_draft_ids: torch.Tensor | None = None  # the draft vocabulary stored with the assistant, if any
    # what transformers' generate (hf-*) runs on: plain copies (`load_plain`); None: `target` / `assistant`, for
    # callers whose models are plain already (our engine gives a bf16 CPU target row blocks and row attention in place
    # when it first runs on it, so the bench always loads separate copies)
    plain_target: torch.nn.Module | None = None
    plain_assistant: torch.nn.Module | None = None
    llama_cpp: object = None  # llama_cpp.Llama on the target's GGUF file (`llama-cpp`)
    integer_products: bool = False  # ours: the target's GGUF codes multiplied as integers (`--products int8`)
    static_cache: object = None  # ours: the target's static cache (its packed CPU step), handed from pass to pass
    verify_costs: dict = field(default_factory=dict)  # ours: the decoders' measured verify costs, shared likewise

    def for_hf(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """(target, assistant) of the hf-* methods."""
        return (self.target if self.plain_target is None else self.plain_target,
                self.assistant if self.plain_assistant is None else self.plain_assistant)

    @cached_property
    def assistant_drafter(self):
        """The assistant as a TransformerDrafter (the assistant: methods' drafter), proposing from its draft
        vocabulary when it has one (transformers' assisted generation always scores the assistant's full vocabulary)."""
        from mamba_draft.transformer import TransformerDrafter

        return TransformerDrafter(self.assistant, self.assistant_draft_ids)


def timed(fn, device: torch.device):
    """(fn(), its wall seconds), the device synchronized before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


@torch.no_grad()
def run_hf(method: Method, models: Models, ids: torch.Tensor, max_new_tokens: int, sampling: dict,
           eos: list[int], pad: int | None, mask: torch.Tensor | None = None) -> tuple[list, dict]:
    """transformers `generate`, alone or assisted, on the plain copies (`Models.for_hf`): `ids` (1, L) -> (new tokens,
    record); with `mask`, a left-padded batch (B, L) -> (new tokens per row, record). `sampling` holds resolved values
    (bench.run_benchmark), passed explicitly so that the generation_config cannot add a top-k or top-p our methods
    do not apply (top_k 0 is off in transformers too)."""
    sample = sampling["temperature"] > 0  # greedy: None, so that no generation_config value applies
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad,
                  attention_mask=torch.ones_like(ids) if mask is None else mask, do_sample=sample,
                  **(sampling if sample else dict.fromkeys(sampling)))
    target, assistant = models.for_hf()
    kwargs |= {"hf-assisted": {"assistant_model": assistant},
               "hf-lookup": {"prompt_lookup_num_tokens": LOOKUP_TOKENS}}.get(method.kind, {})
    forwards = []  # target forward calls = verification rounds
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        out, wall = timed(lambda: target.generate(ids, **kwargs), ids.device)
    finally:
        hook.remove()
    rows = [until_eos(row, eos) for row in out[:, ids.shape[1]:].tolist()]  # a batch pads rows that ended early
    new = sum(map(len, rows))
    # τ counts per row-round: a batch decodes one token per row and forward (τ 1), a lone prompt's rounds are
    # the target's forward calls (assisted generation: fewer than its tokens)
    record = {"new_tokens": new, "wall_time": wall, "rounds": len(forwards) if mask is None else new, "accepted": new,
              "target_forwards": len(forwards)}
    return (rows[0] if mask is None else rows), record


def until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """Tokens up to and including the first EOS (what a row generated before it stopped)."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def run_ours(method: Method, models: Models, ids: torch.Tensor, max_new_tokens: int, sampling: dict,
             eos: list[int], policy, seed: int, mask: torch.Tensor | None, decoders: dict) -> tuple[list, dict]:
    """Our harness: `generate_autoregressive` for `ar`, tree speculative `generate` for the rest. `ids` (1, L) ->
    (new tokens, record); with `mask`, a left-padded batch (B, L) -> (new tokens per row, record), row b seeded
    seed + b. rounds counts row-rounds (a batch's τ = accepted / rounds); batch_rounds the batched rounds.
    `decoders`: the pass's SpeculativeDecoders (what they keep across calls: caches, compiled step, verify costs),
    filled here."""
    from tree_search.generate import SpeculativeDecoder

    # a batch goes to generate as its list of prompts (any length, even one), which it left-pads as `ids` are
    prompts = ids if mask is None else [row[keep.bool()] for row, keep in zip(ids, mask)]
    # a persistent bandit's summary counts every call's pulls (others restart at the call): record this call's
    kept = getattr(policy, "persistent", False)
    before = {a: v["pulls"] for a, v in policy.summary().items()} if kept else {}

    lookup = lookup_of(method, ids.device, mask is not None)  # 0 for `ar`, whose Method has lookup 0
    if lookup not in decoders:
        drafter = None if method.kind == "ar" else (models.drafter if method.drafter == "drafter"
                                                     else models.assistant_drafter)
        decoders[lookup] = SpeculativeDecoder(models.target, drafter, tree=policy, verifier=method.verifier,
                                              tokenizer=models.tokenizer, lookup_tokens=lookup,
                                              integer_products=models.integer_products)

    decoder = decoders[lookup]
    if decoder.static_cache is None:  # every pass decodes on one packed target step (packing one costs a second)
        decoder.static_cache = models.static_cache
    decoder.costs = models.verify_costs  # and plans from one measurement of the verify costs
    result, wall = timed(lambda: decoder.generate(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                                  seed=seed, **sampling), ids.device)
    models.static_cache = decoder.static_cache
    s = result.stats
    record = {"new_tokens": s.new_tokens, "wall_time": wall, "rounds": len(s.accepted_lengths),
              "accepted": sum(s.accepted_lengths), "draft_time": s.draft_time, "verify_time": s.verify_time,
              "lossy_accepts": s.lossy_accepts, "drafter_state_bytes": s.drafter_state_bytes,
              "arm_pulls": {a: v["pulls"] - before.get(a, 0) for a, v in s.arms.items()}}
    if mask is None:
        return result.new_tokens[0].tolist(), record
    return result.new_tokens, record | {"batch_rounds": s.rounds}
