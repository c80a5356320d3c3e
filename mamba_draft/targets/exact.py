"""Exact low-precision targets on a CPU: a position's logits are the same bits however many tokens, and which other
batch rows, share its forward, so speculative output equals plain decoding token for token.

Two constructions, each exact by itself (docs/benchmarks.md, "Exact on every CPU kind"):
- every linear layer multiplies its rows in blocks of fixed row counts (`row_blocks`): a CPU library picks its kernel,
  and so its rounding, by the product's shape, and a fixed shape gives a row the same bits wherever it sits;
- attention computes each query row alone, over its own visible keys in position order (`row_attention`).
A prompt's prefill needs neither: every path computes a prompt by the same prefill call (`prefilling`, one prompt
per call), so it runs transformers' fastest kernels. Both change the model, so they happen in one explicit step,
`prepare_target` (which `load_causal_lm` takes for what it loads); the engine refuses an unprepared bf16 CPU target
it would run through transformers' forward (`require_prepared`), never preparing one behind the caller's back. The
compiled step (`cpu_step`) is exact by itself and needs no preparation.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..packed_linear import pack_linears
from .facts import UnsupportedTargetError
from .row_attention import PREFILL, ROW_STABLE, register
from .row_blocks import RowBlocks, low_precision_cpu, make_row_invariant, row_block

PROBE = "mamba_draft_probe"  # a counting attention implementation, set only while `_attention_is_swappable` asks


def prepare_target(model: nn.Module) -> nn.Module:
    """Prepare a bf16/fp16 CPU `model` for exact speculative decoding (module doc), in place, and return it: its
    attention implementation becomes row attention ("row_stable"), its linear layers multiply prepacked weights in
    row blocks (their classes are swapped for subclasses). Idempotent; fp32 models and models off the CPU, which need
    none of it, are left as they are. A model whose forward does not route attention through transformers'
    AttentionInterface cannot be prepared (one-line ValueError)."""
    if not low_precision_cpu(model):
        return model
    if getattr(model.config, "_attn_implementation", None) != ROW_STABLE:
        if not getattr(model, "_can_set_attn_implementation", lambda: False)() or not _attention_is_swappable(model):
            raise ValueError(f"{type(model).__name__} cannot change its attention implementation, so its bf16/fp16 "
                             "output on a CPU cannot be made exact; run it in float32 (model.float())")
        model.set_attn_implementation(register())
    pack_linears(model)
    make_row_invariant(model)
    return model


def is_prepared(model: nn.Module) -> bool:
    """Whether `model` is bf16/fp16 on a CPU and `prepare_target`'s construction is in place."""
    return (low_precision_cpu(model) and getattr(model.config, "_attn_implementation", None) == ROW_STABLE
            and row_block(model) is not None)


def require_prepared(model: nn.Module) -> None:
    """Refuse, in one line, a bf16/fp16 CPU target that decodes through transformers' forward unprepared: its
    products and attention round a row by what else shares the forward, so speculation would not be lossless."""
    if low_precision_cpu(model) and not is_prepared(model):
        raise UnsupportedTargetError(
            f"this bf16/fp16 {type(model).__name__} on a CPU is not prepared for exact decoding: call "
            "mamba_draft.targets.prepare_target(model) once (it changes the model in place: row attention, prepacked "
            "row-blocked linear layers), load it with mamba_draft.targets.load_causal_lm, or run it in float32")


class _Routed(Exception):
    """Raised by the probing attention at its first call: the forward asked the AttentionInterface."""


@torch.no_grad()
def _attention_is_swappable(model: nn.Module) -> bool:
    """Whether `model`'s forward really computes attention through transformers' AttentionInterface: a forward with a
    probing implementation set, which stops at its first call. transformers only guesses it from the model's source,
    and a model whose own attention code ignored the setting would decode with attention that is not exact."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def routed(*args, **kwargs):
        raise _Routed

    AttentionInterface.register(PROBE, routed)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(PROBE)
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    except _Routed:
        return True
    except Exception:  # a forward that cannot run with it set: not swappable either
        return False
    finally:
        model.set_attn_implementation(before)
    return False


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
