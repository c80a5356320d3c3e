"""Exact low-precision targets on a CPU: a position's logits are the same bits however many tokens, and which other
batch rows, share its forward, so speculative output equals plain decoding token for token.

Two constructions, each exact by itself (docs/benchmarks.md, "Exact on every CPU kind"):
- every linear layer multiplies its rows in blocks of fixed row counts (`row_blocks`): a CPU library picks its kernel,
  and so its rounding, by the product's shape, and a fixed shape gives a row the same bits wherever it sits;
- attention computes each query row alone, over its own visible keys in position order (`row_attention`).
A prompt's prefill needs neither: every path computes a prompt by the same prefill call (`prefilling`, one prompt
per call), so it runs transformers' fastest kernels.
"""
from __future__ import annotations

import contextlib

from torch import nn

from ..packed_linear import pack_linears
from .row_attention import PREFILL, ROW_STABLE, register
from .row_blocks import RowBlocks, low_precision_cpu, make_row_invariant


def make_exact(model: nn.Module) -> bool:
    """Give a bf16/fp16 CPU `model` the exact construction in place, however it was loaded: prepacked weights, row
    blocks and row attention (idempotent). Other models are left as they are. Returns whether it is exact."""
    if not low_precision_cpu(model):
        return False
    if getattr(model.config, "_attn_implementation", None) != ROW_STABLE:
        if not getattr(model, "_can_set_attn_implementation", lambda: False)():
            raise ValueError(f"{type(model).__name__} cannot change its attention implementation, so its bf16/fp16 "
                             "output on a CPU cannot be made exact; run it in float32 (model.float())")
        model.set_attn_implementation(register())
    pack_linears(model)
    make_row_invariant(model)
    return True


@contextlib.contextmanager
def prefilling(model: nn.Module):
    """Inside, an exact `model` computes with plain products and transformers' sdpa attention (`PREFILL`): for one
    prompt's prefill, which only has to agree with itself."""
    layers = [m for m in model.modules() if isinstance(m, RowBlocks)]
    switch = getattr(model.config, "_attn_implementation", None) == ROW_STABLE
    for layer in layers:
        layer.active = None
    if switch:
        model.config._attn_implementation = PREFILL
    try:
        yield
    finally:
        for layer in layers:
            layer.active = layer.sizes
        if switch:
            model.config._attn_implementation = ROW_STABLE
