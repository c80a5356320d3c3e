"""The drafter interface the tree engine drafts with, and the one loader every command uses.

A drafter is an `nn.Module` with an explicit state of rows (`allocate_state(rows)`: `max_batch`, `device`, `nbytes`,
`rows(start, stop)` views, `gather_(dst, src_rows)` forks, `reset_()`), and:

    prefill(ids (B, L), state) -> (last logits (B, V), state)    encode rows [0:B] from scratch
    extend(ids (B, L), state, last_only) -> logits               continue rows [0:B]
    step(tokens (B,), state) -> logits (B, V)                     one token per row (one tree level)
    vocab_size / input_vocab_size / draft_ids / device / dtype / state_dtype / backend
    capturable (CUDA graphs of `step`), row_bytes(context) (memory of one state row)

`MambaDrafter` (recurrent state, fixed size per row) and `TransformerDrafter` (any HF causal LM, a KV cache per row)
implement it; tree drafting, resync after a commit, lossless sampling, lossy verifiers and the bandit sit above it.
"""
from __future__ import annotations

import os

import torch

from .checkpoint import SHIPPED_DRAFTER, detect_format, read_config, resolve_directory


def is_mamba_checkpoint(path: str | os.PathLike, revision: str | None = None) -> bool:
    """Whether `path` (directory, hub id or `smollm2`) holds a Mamba drafter (HF or mamba_ssm format)."""
    if str(path) == SHIPPED_DRAFTER:
        return True
    try:
        detect_format(read_config(resolve_directory(path, revision)))
    except ValueError:
        return False
    return True


def load_drafter(path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 embedding: torch.Tensor | None = None, revision: str | None = None,
                 state_dtype: torch.dtype | None = torch.float32):
    """A `MambaDrafter` for a Mamba checkpoint (`MambaDrafter.from_pretrained`: HF or mamba_ssm format, a hub id, or
    `smollm2`; `embedding` is the target's, for a drafter stored without its own), else a `TransformerDrafter` of
    the HF causal LM there. state_dtype: a Mamba drafter's recurrent state (fp32 by default whatever `dtype`: a
    step is bound by reading the weights, which bf16 halves, while a bf16 state would round at every token; None:
    `dtype`)."""
    if is_mamba_checkpoint(path, revision):
        from .model import MambaDrafter

        return MambaDrafter.from_pretrained(str(path), device=device, dtype=dtype, revision=revision,
                                            embedding=embedding, state_dtype=state_dtype)
    from .transformer import TransformerDrafter

    try:
        return TransformerDrafter.from_pretrained(str(path), device=device, dtype=dtype, revision=revision)
    except OSError as err:
        raise ValueError(f"drafter {path} is neither a Mamba checkpoint nor a causal LM transformers can load "
                         f"({err})") from err
