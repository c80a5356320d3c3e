"""The Mamba drafter's state (a `mamba_draft.drafter.DraftState`): per-layer conv and SSM buffers, preallocated for
a maximum batch and only written in place, so a CUDA graph captured on a view of them stays valid across rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DrafterState:
    conv: torch.Tensor  # (n_layer, max_batch, conv_dim, d_conv)
    ssm: torch.Tensor  # (n_layer, max_batch, *ssm_state_shape)

    @property
    def max_batch(self) -> int:
        return self.conv.shape[1]

    @property
    def device(self) -> torch.device:
        return self.conv.device

    @property
    def nbytes(self) -> int:
        """Memory of these rows' buffers: fixed, whatever the context."""
        return self.conv.nbytes + self.ssm.nbytes

    def rows(self, start: int, stop: int) -> "DrafterState":
        """A state viewing rows [start:stop] of this one (no copy: writes through)."""
        if not 0 <= start < stop <= self.max_batch:
            raise IndexError(f"rows [{start}:{stop}] out of range for a state of {self.max_batch} rows")
        return DrafterState(self.conv[:, start:stop], self.ssm[:, start:stop])

    def gather_(self, dst_start: int, src_rows: torch.Tensor) -> "DrafterState":
        """rows[dst_start : dst_start + len(src_rows)] = rows[src_rows]; safe when source and destination overlap."""
        n = src_rows.shape[0]
        if dst_start < 0 or dst_start + n > self.max_batch:
            raise IndexError(f"gather of {n} rows at {dst_start} overflows a state of {self.max_batch} rows")
        # index_select materialises the sources before the copy, so overlapping rows are read before written.
        for buffer in (self.conv, self.ssm):
            buffer[:, dst_start:dst_start + n].copy_(buffer.index_select(1, src_rows))
        return self

    def reset_(self) -> "DrafterState":
        self.conv.zero_()
        self.ssm.zero_()
        return self

    def clone(self) -> "DrafterState":
        return DrafterState(self.conv.clone(), self.ssm.clone())
