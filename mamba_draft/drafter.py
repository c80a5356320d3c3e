"""The drafter interface the tree engine drafts with (`Drafter`, `DraftState`), and the one loader every command uses.

`MambaDrafter` (recurrent state, fixed size per row) and `TransformerDrafter` (a KV cache per row) implement it,
declared in their docstrings rather than by subclassing (this module loads them: either import would be a cycle);
tests/test_transformer_drafter.py checks both against the protocols.
"""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

from .checkpoint import detect_format, read_config, resolve_directory


@runtime_checkable
class DraftState(Protocol):
    """A drafter's state: preallocated rows (`DrafterState`: conv and SSM buffers; `KVState`: KV caches)."""

    max_batch: int  # rows this state (or view) holds
    device: torch.device
    nbytes: int  # memory of the buffers behind it

    def rows(self, start: int, stop: int) -> DraftState:
        """A view of rows [start:stop] (no copy: writes go through)."""

    def gather_(self, dst_start: int, src_rows: torch.Tensor) -> DraftState:
        """rows[dst_start : dst_start + len(src_rows)] = rows[src_rows], overlap-safe: the fork of tree drafting."""

    def reset_(self) -> DraftState:
        """Empty every row (as before a prefill)."""


@runtime_checkable
class Drafter(Protocol):
    """What the tree engine drafts with; an `nn.Module` besides (`parameters()`)."""

    capturable: bool  # `step` can be captured in a CUDA graph (fixed shapes, no host sync)
    backend: str  # what runs `step`: 'torch', 'kernels' (Mamba on CUDA) or 'hf'
    state_dtype: torch.dtype | None  # a Mamba drafter's recurrent state (None: `dtype`)
    draft_ids: torch.Tensor | None  # logit column j scores target id draft_ids[j] (None: id j)
    vocab_size: int  # width of the logits (the draft vocabulary's size, if it has one)
    input_vocab_size: int  # token ids the drafter reads
    reads_target: bool  # `extend` / `step` take `features`: the target's final hidden state before each token
    device: torch.device
    dtype: torch.dtype

    def allocate_state(self, max_batch: int) -> DraftState: ...

    def row_bytes(self, context: int) -> int:
        """Bytes of one state row holding `context` tokens."""

    def prefill(self, input_ids: torch.Tensor, state: DraftState | None = None,
                max_batch: int | None = None) -> tuple[torch.Tensor, DraftState]:
        """Encode (B, L) from scratch into rows [0:B] -> (last-position logits (B, V), state)."""

    def extend(self, input_ids: torch.Tensor, state: DraftState, *, last_only: bool = False) -> torch.Tensor:
        """Continue rows [0:B] with a (B, L) block -> logits (B, L, V), or (B, V) with last_only."""

    def step(self, token_ids: torch.Tensor, state: DraftState) -> torch.Tensor:
        """One token per row (B,) -> logits (B, V)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits (B, L, V) from an empty state."""


def load_drafter(path: str | os.PathLike, *, target: torch.nn.Module | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 embedding: torch.Tensor | None = None, revision: str | None = None,
                 state_dtype: torch.dtype | None = torch.float32):
    """A `MambaDrafter` for a Mamba checkpoint (`MambaDrafter.from_pretrained`), else a `TransformerDrafter`.
    target: the loaded target, whose input embedding serves a drafter stored without its own (`embedding`: that
    embedding alone; not both). device / dtype: default the target's, else cpu / float32. state_dtype: a Mamba
    drafter's recurrent state (by default fp32 whatever `dtype`: a bf16 one rounds at every token; None: `dtype`)."""
    if target is not None:
        if embedding is not None:
            raise ValueError("load_drafter takes target= or embedding=, not both: target= already supplies "
                             "target.get_input_embeddings().weight; drop embedding=")
        embedding = target.get_input_embeddings().weight
        device = embedding.device if device is None else device
        dtype = getattr(target, "dtype", embedding.dtype) if dtype is None else dtype
    device = "cpu" if device is None else device
    dtype = torch.float32 if dtype is None else dtype
    try:
        detect_format(read_config(resolve_directory(path, revision)))
    except ValueError:  # not a Mamba checkpoint (either format): a causal LM transformers may load
        pass
    else:
        from .model import MambaDrafter

        return MambaDrafter.from_pretrained(str(path), device=device, dtype=dtype, revision=revision,
                                            embedding=embedding, state_dtype=state_dtype)
    from .transformer import TransformerDrafter

    try:
        return TransformerDrafter.from_pretrained(str(path), device=device, dtype=dtype, revision=revision)
    except OSError as err:
        raise ValueError(f"drafter {path} is neither a Mamba checkpoint nor a causal LM transformers can load "
                         f"({err})") from err
