"""What both drafters share below the interface: token-id and row-count checks, and `prefill` / `forward` on each
drafter's own `extend` and `allocate_state` (`SharedCalls`). Imports only torch: no cycle through `drafter.py`.
"""
from __future__ import annotations

import torch

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_batch(batch: int, state) -> int:
    if batch > state.max_batch:
        raise ValueError(f"batch of {batch} rows exceeds the state's preallocated max_batch={state.max_batch}; "
                         "allocate_state(max_batch) with room for every row")
    return batch


class SharedCalls:
    """`prefill` and `forward` of a drafter (mixed in before `nn.Module`), on the drafter's own
    `extend(ids, state, last_only=)`, `allocate_state(rows)`, `device` and `embedding_rows` (the ids it reads)."""

    def token_ids(self, input_ids) -> torch.Tensor:
        """Token ids (batch, length) as int64 on this drafter's device; TypeError for non-integers, ValueError for a
        wrong shape or an id outside its embedding's rows."""
        if not isinstance(input_ids, torch.Tensor):
            try:
                input_ids = torch.as_tensor(input_ids)
            except (TypeError, ValueError) as err:
                raise TypeError(f"token ids must be integers, got {type(input_ids).__name__}") from err
        if input_ids.dtype not in ID_DTYPES:
            raise TypeError(f"token ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"token ids must have shape (batch, length), got {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.embedding_rows):
            raise ValueError(f"token ids must lie in [0, {self.embedding_rows}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return input_ids.to(device=self.device, dtype=torch.long)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state=None, max_batch: int | None = None):
        """Encode a prompt (B, L) from scratch into rows [0:B]; returns last-position logits (B, V) and the state
        (without `state`, one allocated for max(B, max_batch) rows: tree drafting needs room for every node)."""
        ids = self.token_ids(input_ids)
        if ids.shape[1] == 0:
            raise ValueError("prefill needs at least one token")
        if state is None:
            state = self.allocate_state(max(ids.shape[0], max_batch or 0))
        state.rows(0, check_batch(ids.shape[0], state)).reset_()
        return self.extend(ids, state, last_only=True), state

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits (B, L, V) from an empty state (the reference for everything else)."""
        ids = self.token_ids(input_ids)
        return self.extend(ids, self.allocate_state(ids.shape[0]))
