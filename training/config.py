"""Training configuration: dataclasses, strict YAML loading and `key=value` command-line overrides."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class ModelConfig:
    arch: str = "mamba1"                  # mamba1 | mamba2 | llama
    tokenizer: str = ""                   # hub id or local path; the drafter must share the target's tokenizer
    init_from: str | None = None          # HF checkpoint to start from (e.g. SFT after pretraining)
    vocab_size: int | None = None         # None: len(tokenizer) rounded up to pad_vocab_multiple
    pad_vocab_multiple: int = 8
    hidden_size: int = 768
    num_hidden_layers: int = 24
    state_size: int = 16                  # mamba1 / mamba2 SSM state
    expand: int = 2
    conv_kernel: int = 4
    num_heads: int = 0                    # mamba2 heads (0: hidden_size * expand // head_dim); llama attention heads
    head_dim: int = 64                    # mamba2 head dim
    n_groups: int = 1                     # mamba2 B/C groups
    intermediate_size: int = 0            # llama MLP (0: 4 * hidden_size)
    num_key_value_heads: int = 0          # llama (0: num_heads)
    max_position_embeddings: int = 4096   # llama
    tie_word_embeddings: bool = True
    draft_vocab_size: int = 0             # > 0: propose only the N most frequent target ids of the training data
    draft_vocab: str | None = None        # or a draft_vocab.safetensors file / drafter directory to reuse
    init_embeddings_from: str | None = None  # target whose input embedding initialises the drafter's (same width)
    freeze_embeddings: bool = False
    target_hidden_size: int = 0           # > 0: a drafter that reads the target's final hidden state (this wide;
                                          # engine data made with --hidden). 0: token ids only
    drafted_features: str = "stand_in"    # beside a drafted token: "stand_in" (a learned vector) or "own" (its own
                                          # final-norm state at the token before: EAGLE)


@dataclass
class DataConfig:
    kind: str = "pretrain"                # pretrain | sft | engine (a make-data directory: cached target top-K)
    path: str = ""                        # local file/glob (json, jsonl, parquet) or hub dataset id
    hub_config: str | None = None         # e.g. "sample-10BT" for HuggingFaceFW/fineweb-edu
    split: str = "train"
    streaming: bool = False               # hub datasets: stream instead of downloading
    text_column: str = "text"             # pretraining
    seq_len: int = 2048                   # packed length (pretrain) / truncation length (sft)
    shuffle_buffer: int = 10_000          # streaming shuffle buffer
    seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 0
    warmup_ratio: float = 0.0             # used when warmup_steps == 0
    lr_min_ratio: float = 0.1             # cosine floor, as a fraction of lr
    clip: float = 1.0


@dataclass
class DistillConfig:
    target: str | None = None             # frozen target model (HF dir or hub id); None: plain CE training
    ce_weight: float = 0.0                # loss = ce_weight * CE + kl_weight * KL(target || drafter)
    kl_weight: float = 1.0
    feature_weight: float = 0.0           # + feature_weight * SmoothL1(drafter state, target's) (make-data --hidden)
    temperature: float = 1.0
    draft_windows: int = 0                # K > 1: a drafter that reads the target trains on simulated draft windows
                                          # of 1..K-1 positions read with the stand-in (training.target_features)
    window_rate: float = 0.15             # with draft_windows: the probability that a reply position opens one


@dataclass
class EvalConfig:
    """Held-out agreement with the target (training/agreement.py), logged to metrics.jsonl and agreement.png."""
    data: str = ""                        # held-out file: SFT (conversations / messages, like data.path) or text
    every: int = 0                        # evaluate every N optimizer steps and after the last one; 0: off
    max_sequences: int = 64               # the file's first N records (kept cheap: every evaluation runs them all)
    gammas: tuple[int, ...] = (1, 3, 5)   # chain lengths for tau
    target: str | None = None             # model whose greedy choices are scored; None: distill.target


@dataclass
class TrainConfig:
    output_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: str = "configs/deepspeed/zero1.json"   # DeepSpeed JSON (ZeRO stage, bf16)
    precision: str = "auto"               # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    steps: int = 0                        # optimizer steps; 0: derived from epochs (sft)
    epochs: float = 0.0
    global_batch_size: int = 8            # sequences per optimizer step over all ranks
    micro_batch_size: int = 1             # sequences per rank per forward
    seed: int = 0
    log_every: int = 1
    checkpoint_every: int = 1000
    tensorboard: bool = False
    build_shm_comm: bool = True           # False: skip DeepSpeed's CPU shm op JIT (inference-only, unused in training)
    hang_after_step: int | None = None    # fault injection for resume tests: block forever after this step's checkpoint


class ConfigError(ValueError):
    """A configuration file or override names an unknown key or holds a value of the wrong type."""


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Dataclass defaults <- YAML file <- `a.b=value` overrides (values parsed as YAML). Unknown keys are errors."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[leaf] = yaml.safe_load(value)
    return _build(TrainConfig, raw, "")


def _build(cls, raw: dict, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; "
                          f"valid keys in {where or 'top level'}: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _coerce(hints[name], value, where + name) for name, value in raw.items()})


def _coerce(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if args[-1] is Ellipsis:  # tuple[int, ...]: any length
            args = (args[0],) * len(value)
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value))
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {value!r}") from None
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def to_dict(cfg: TrainConfig) -> dict:
    """Plain (YAML-serialisable: tuples as lists) dict of a config."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def save_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
