"""Drafter checkpoints in HF format (`config.json` with `model_type` mamba / mamba2, `model.safetensors` or a sharded
index) and mamba_ssm format (`MambaLMHeadModel`: `config.json` with `ssm_cfg`, `pytorch_model.bin`, the embedding as
`backbone.embedding.weight`, the vocabulary padded), with HF names in memory. Beside the weights, so the model part
still loads in plain transformers: `draft_vocab.safetensors` (`d2t`: draft id -> target id; `DRAFT_IDS` in memory),
and `target_embedding.json` for a drafter stored without its (frozen, tied) embedding (`target_embedding`). Weights
are read with safetensors or `torch.load(weights_only=True)` only; directories are written whole or not at all.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import targets  # its loaders by attribute: tests stand in for them
from .config import MambaConfig
from .io import atomic_directory

FORMATS = ("hf", "mamba_ssm")
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
SSM_WEIGHTS = "pytorch_model.bin"
DRAFT_VOCAB = "draft_vocab.safetensors"
DRAFT_IDS = "draft_vocab.d2t"  # in-memory key of the id map (mamba_draft.model imports it from here)
TARGET_EMBEDDING = "target_embedding.json"
EMBEDDING = "backbone.embeddings.weight"
SHIPPED_DRAFTER = "smollm2"  # the default drafter for the shipped target: reads the target's hidden state
# accepted wherever a drafter path is: directories under mamba_draft/drafters/ (the external one reads token ids only)
SHIPPED_DRAFTER_NAMES = (SHIPPED_DRAFTER, "smollm2-external")
SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"
# The --drafter help every command shares.
DRAFTER_HELP = ("drafter: a Mamba checkpoint (HF or mamba_ssm format), any HF causal LM sharing the target's tokenizer "
                "(a Transformer drafter), a hub id, or a drafter shipped for the shipped target: "
                + " or ".join(repr(name) for name in SHIPPED_DRAFTER_NAMES) + " (the first is the default)")
# Files copied alongside the weights on save/convert so the directory stays usable with its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_directory(path: str | os.PathLike, revision: str | None = None) -> Path:
    """A shipped drafter's directory for its name (`SHIPPED_DRAFTER_NAMES`); a local directory as is; otherwise a
    hub id (`org/name`) downloaded through huggingface_hub's cache."""
    if str(path) in SHIPPED_DRAFTER_NAMES:
        shipped = SHIPPED_DRAFTERS / str(path)
        if not (shipped / "config.json").is_file():
            raise FileNotFoundError(f"the shipped drafter {path} is missing from this installation ({shipped})")
        return shipped
    local = Path(path)
    if local.exists():
        if not local.is_dir():
            raise NotADirectoryError(f"checkpoint path {local} is a file; expected a directory with config.json")
        return local
    if not _HUB_ID.match(str(path)):
        raise FileNotFoundError(f"checkpoint directory {local} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), revision=revision,
                                      allow_patterns=["config.json", "*.safetensors", HF_INDEX, SSM_WEIGHTS,
                                                      *TOKENIZER_FILES]))
    except Exception as err:
        raise FileNotFoundError(f"{path!r} is neither a local directory nor a downloadable hub repository: "
                                f"{err}") from err


def detect_format(config: dict) -> str:
    if config.get("model_type") in ("mamba", "mamba2"):
        return "hf"
    if "d_model" in config and "n_layer" in config:
        return "mamba_ssm"
    raise ValueError(f"config.json describes an unknown architecture (model_type={config.get('model_type')!r}, "
                     f"architectures={config.get('architectures')!r}); expected an HF MambaForCausalLM/"
                     "Mamba2ForCausalLM config or a mamba_ssm MambaLMHeadModel config")


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def embedding_digest(weight: torch.Tensor) -> str:
    """SHA-256 of an embedding rounded to bf16 (the dtype a target is loaded in does not change it)."""
    rounded = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return hashlib.sha256(rounded.view(torch.int16).numpy().tobytes()).hexdigest()


def embedding_spec(directory: Path) -> tuple[str, str, tuple[int, ...]]:
    """(target, sha256 of its bf16-rounded embedding, shape) from a directory's `target_embedding.json`."""
    try:
        spec = json.loads((directory / TARGET_EMBEDDING).read_text())
        return spec["target"], spec["sha256_bf16"], tuple(spec["shape"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{directory / TARGET_EMBEDDING} is malformed: {err}") from err


def target_embedding(directory: Path, embedding: torch.Tensor | None) -> torch.Tensor:
    """The embedding a `target_embedding.json` directory takes from its target, checked against its digest."""
    target, digest, shape = embedding_spec(directory)
    if embedding is None:
        embedding = targets.load_causal_lm(target, attn_implementation=None).get_input_embeddings().weight
    if tuple(embedding.shape) != shape or embedding_digest(embedding) != digest:
        raise ValueError(f"{directory} was trained on the embedding of {target!r} (shape {shape}, sha256 "
                         f"{digest[:12]}...); the target given has another ({tuple(embedding.shape)}, "
                         f"{embedding_digest(embedding)[:12]}...)")
    return embedding.detach().to(device="cpu", dtype=torch.float32)


def load_checkpoint(path: str | os.PathLike, revision: str | None = None,
                    embedding: torch.Tensor | None = None) -> tuple[MambaConfig, dict]:
    """A checkpoint of either format: its MambaConfig and tensors under HF names. `embedding`: the target's input
    embedding, for a directory stored without its own (not given: the target is loaded for it); else ignored."""
    directory = resolve_directory(path, revision)
    raw = read_config(directory)
    if detect_format(raw) == "hf":
        config = MambaConfig.from_hf_dict(raw)
        tensors = _read_hf_weights(directory)
    else:
        config = MambaConfig.from_mamba_ssm_dict(raw)
        tensors = {k.replace("backbone.embedding.", "backbone.embeddings.", 1): v
                   for k, v in _read_weights_file(directory / SSM_WEIGHTS).items()}
    if (draft_ids := read_draft_ids(directory)) is not None:
        tensors[DRAFT_IDS] = draft_ids
    if (directory / TARGET_EMBEDDING).is_file() and EMBEDDING not in tensors:
        tensors[EMBEDDING] = target_embedding(directory, embedding)
    return config, tensors


def check_tensors(model, tensors: dict, where: str = "checkpoint") -> dict:
    """`tensors` (HF names) less a tied head's copy, checked against `model`'s state dict (a meta model will do):
    ValueError naming the first missing, unexpected or misshaped keys. A `DRAFT_IDS` entry passes through."""
    tied = model.config.tie_embeddings
    tensors = {k: v for k, v in tensors.items() if not (tied and k == "lm_head.weight")}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    given = set(tensors) - {DRAFT_IDS}
    missing, unexpected = sorted(set(expected) - given), sorted(given - set(expected))
    if missing or unexpected:
        first = lambda names: f"{names[:8]}{'...' if len(names) > 8 else ''}"
        raise ValueError(f"{where} does not match the config: missing {first(missing)}, unexpected "
                         f"{first(unexpected)}")
    bad = [f"{k}: checkpoint {tuple(tensors[k].shape)} vs config {shape}"
           for k, shape in expected.items() if tuple(tensors[k].shape) != shape]
    if bad:
        raise ValueError(f"{where}: shape mismatch between config.json and weights: " + "; ".join(bad[:8]))
    return tensors


def check_draft_ids(draft_ids, vocab: int, device=None, vocab_name: str = "") -> torch.Tensor:
    """A draft vocabulary as a long tensor on `device`: non-empty, 1-D, integer, distinct ids in [0, vocab)
    (`vocab_name`, e.g. "the target's vocabulary ", names that range in the error)."""
    ids = torch.as_tensor(draft_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft vocabulary must be a non-empty 1-D integer tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"draft vocabulary ids must lie in {vocab_name}[0, {vocab}), got [{int(ids.min())}, "
                         f"{int(ids.max())}]")
    if torch.unique(ids).numel() != ids.numel():  # a repeated id would get only one column's share of q
        raise ValueError("draft vocabulary ids must be distinct")
    return ids.to(device=device, dtype=torch.long)


def read_draft_ids(path: str | os.PathLike) -> torch.Tensor | None:
    """The id map (`d2t`) of a draft_vocab.safetensors file or of a model directory holding one, else None."""
    file = Path(path) / DRAFT_VOCAB if Path(path).is_dir() else Path(path)
    if not file.is_file():
        return None
    draft = _read_weights_file(file)
    if "d2t" not in draft:
        raise ValueError(f"{file} has no 'd2t' tensor")
    return draft["d2t"]


def _read_hf_weights(directory: Path) -> dict:
    single, index = directory / HF_WEIGHTS, directory / HF_INDEX
    if single.is_file():
        return _read_weights_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in _read_weights_file(directory / shard).items()}
    if (directory / SSM_WEIGHTS).is_file():  # older HF checkpoints saved as .bin
        return _read_weights_file(directory / SSM_WEIGHTS)
    raise FileNotFoundError(f"{directory} has no weights ({HF_WEIGHTS}, {HF_INDEX} or {SSM_WEIGHTS})")


def _read_weights_file(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} is missing")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # SafetensorError, and unpickling errors of many types
        raise ValueError(f"weights file {path} is corrupt or unreadable: {err}") from err
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise ValueError(f"weights file {path} does not hold a flat state dict of tensors")
    return tensors


def save_checkpoint(config: MambaConfig, tensors: dict, directory: str | os.PathLike, *, format: str = "hf",
                    overwrite: bool = False, copy_from: Path | None = None, dtype: torch.dtype | None = None,
                    embedding_from: str | None = None, tokenizer=None) -> Path:
    """Write `tensors` (HF names) in `format`, atomically. `dtype`: cast floating-point tensors (e.g. bf16 to
    ship). `embedding_from`: the target whose input embedding this drafter uses (tied and frozen): the embedding is
    left out and `target_embedding.json` records the target and the embedding's digest (HF format, tied embeddings
    only). `tokenizer`: saved beside the weights."""
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; choose one of {FORMATS}")
    if embedding_from is not None and (format != "hf" or not config.tie_embeddings):
        raise ValueError("embedding_from needs the hf format and a tied embedding")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    draft_ids = tensors.pop(DRAFT_IDS, None)
    embedding = tensors.pop(EMBEDDING) if embedding_from is not None else None
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    with atomic_directory(directory, overwrite=overwrite) as tmp:
        if embedding is not None:
            (tmp / TARGET_EMBEDDING).write_text(json.dumps(
                {"target": embedding_from, "shape": list(embedding.shape),
                 "sha256_bf16": embedding_digest(embedding)}, indent=2) + "\n")
        if draft_ids is not None:
            save_file({"d2t": draft_ids.to(torch.int64)}, str(tmp / DRAFT_VOCAB), metadata={"format": "pt"})
        if format == "hf":
            if config.tie_embeddings:
                tensors.pop("lm_head.weight", None)  # tied: HF stores the embedding once
            save_file(tensors, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
        else:
            if config.tie_embeddings:  # MambaLMHeadModel.state_dict() lists the tied head under both names
                tensors["lm_head.weight"] = tensors[EMBEDDING]
            torch.save({k.replace("backbone.embeddings.", "backbone.embedding.", 1): v for k, v in tensors.items()},
                       tmp / SSM_WEIGHTS)
            (tmp / "config.json").write_text(json.dumps(config.to_mamba_ssm_dict(), indent=2))
        if copy_from is not None:
            for name in TOKENIZER_FILES:
                if (copy_from / name).is_file():
                    shutil.copy2(copy_from / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(directory)
