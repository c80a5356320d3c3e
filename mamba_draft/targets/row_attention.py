"""Row-exact attention for low-precision CPU targets: a query row's output is the same bits whatever else shares
its forward (other rows, other batch rows, hidden keys between its own), so a tree node and the decoding step that
computes the same token agree bit for bit. The arithmetic and why it holds are in `row_attention.c`: a small C
kernel built and cached by `native.build`, called through ctypes.

Registered with transformers as attn_implementation "row_stable" (`register`), with sdpa's boolean masks.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .native import KernelUnavailable, build, loads

ROW_STABLE = "row_stable"
PREFILL = "row_stable_prefill"  # what a row-stable model's prefill runs (`exact.prefilling`)
SOURCE = Path(__file__).with_name("row_attention.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MASK_CAUSAL, MASK_NONE, MASK_BOOL, MASK_F32 = range(4)
SERIAL_WORK = 1 << 17  # multiply-adds below which a call runs on one thread (a short decoding step)


@functools.cache
def library() -> ctypes.CDLL:
    lib = build(SOURCE, "exact bf16/fp16 attention")
    pointer, strides, i32, f32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_float
    lib.row_attention.argtypes = [pointer, strides, pointer, strides, pointer, strides, pointer, strides, i32, pointer,
                                  strides, pointer, *[i32] * 6, i32, f32, f32, i32, i32]
    lib.row_attention.restype = i32
    return lib


def available() -> bool:
    return loads(library)


def _strides(x: torch.Tensor, dims) -> ctypes.Array:
    return (ctypes.c_int64 * 3)(*(x.stride(d) for d in dims))


def row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None,
                  is_causal=None, **_):
    """query (B, H, q, D), key/value (B, KVH, K, D), attention_mask (B or 1, 1, q or 1, K) boolean (True: visible) or
    additive float, or None (causal when q > 1, as sdpa's is_causal) -> ((B, q, H, D), None)."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    dtype = query.dtype
    if key.dtype != dtype or value.dtype != dtype or dtype not in DTYPES:
        raise TypeError(f"row attention takes query, key and value of one of {list(DTYPES)}, got {dtype}, "
                        f"{key.dtype}, {value.dtype}")
    if query.device.type != "cpu":
        raise ValueError("row attention runs on a CPU")
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        kind, mask = (MASK_CAUSAL if causal and queries > 1 else MASK_NONE), None
    else:
        mask = attention_mask[:, 0, :, :keys]
        kind = MASK_BOOL if mask.dtype == torch.bool else MASK_F32
        mask = (mask if kind == MASK_BOOL else mask.float()).expand(batch, queries, keys)
    out = torch.empty(batch, queries, heads, dim, dtype=dtype)
    sinks = None if s_aux is None else s_aux.detach().float().contiguous()
    threads = 1 if batch * heads * queries * keys * dim < SERIAL_WORK else torch.get_num_threads()
    split = batch * queries * kv_heads < 2 * threads
    scale = dim ** -0.5 if scaling is None else float(scaling)
    failed = library().row_attention(
        query.data_ptr(), _strides(query, (0, 1, 2)), key.data_ptr(), _strides(key, (0, 1, 2)), value.data_ptr(),
        _strides(value, (0, 1, 2)), None if mask is None else mask.data_ptr(),
        None if mask is None else _strides(mask, (0, 1, 2)), kind, out.data_ptr(), _strides(out, (0, 2, 1)),
        None if sinks is None else sinks.data_ptr(), batch, heads, kv_heads, queries, keys, dim, DTYPES[dtype],
        scale, float(softcap or 0.0), int(split), threads)
    if failed:
        raise RuntimeError(f"row attention failed (code {failed}): heads {heads}, key heads {kv_heads}, dim {dim}")
    return out, None


def prefill_attention(module, query, key, value, attention_mask, **kwargs):
    """A prompt's prefill (`exact.prefilling`): sdpa, transformers' fastest CPU attention, row attention where sdpa
    lacks the model's softcap or sinks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return row_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Make attn_implementation "row_stable" (and its prefill's) known to transformers, with sdpa's boolean masks;
    idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    library()  # a missing compiler is said here, at load, not at the first forward
    for name, function in ((ROW_STABLE, row_attention), (PREFILL, prefill_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return ROW_STABLE
