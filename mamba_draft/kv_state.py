"""The Transformer drafter's state: one KV cache per row, contiguous from slot 0 (slot = RoPE position), preallocated
and grown geometrically; rows fork by copying their caches (`KVState.gather_`), and a forward writes each row's new
keys at that row's own length (`write_rows`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_rows(cache: torch.Tensor, new: torch.Tensor, starts: list[int], positions: torch.Tensor) -> None:
    """cache[b, :, starts[b] : starts[b] + n] = new[b] for every row b (cache (B, heads, slots, dim), new (B, heads, n,
    dim), positions (B, n) = starts + arange(n)): one slice copy when the rows start together (a tree level, a single
    prompt), else one scatter (which copies the whole cache on CPU: far dearer than a slice copy)."""
    new = new.to(cache.dtype)
    n = new.shape[2]
    if all(start == starts[0] for start in starts):
        cache[:, :, starts[0] : starts[0] + n] = new
    else:
        cache.scatter_(2, positions[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3]), new)


@dataclass
class KVStore:
    """Storage of a KVState: per layer keys / values (rows, heads, slots, head_dim), and each row's length."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # (rows,) long: tokens each row's cache holds
    limit: int  # the model's position limit: capacity never grows past it

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, slots: int) -> None:
        """Room for `slots` tokens per row (doubling, so a long generation reallocates O(log) times)."""
        if slots <= self.capacity:
            return
        if slots > self.limit:
            raise ValueError(f"the Transformer drafter's cache needs {slots} positions, beyond its model's "
                             f"{self.limit} max positions")
        grown = min(max(slots, 2 * self.capacity), self.limit)
        for cache in (self.keys, self.values):
            for i, old in enumerate(cache):
                cache[i] = F.pad(old, (0, 0, 0, grown - old.shape[2]))  # zeros past the old slots


class KVState:
    """Rows [start:stop] of a `KVStore`: the Transformer drafter's `DraftState`, as `DrafterState` is a Mamba one's."""

    def __init__(self, store: KVStore, start: int = 0, stop: int | None = None) -> None:
        self.store, self.start = store, start
        self.stop = store.lengths.shape[0] if stop is None else stop

    @property
    def max_batch(self) -> int:
        return self.stop - self.start

    @property
    def device(self) -> torch.device:
        return self.store.lengths.device

    @property
    def lengths(self) -> torch.Tensor:
        return self.store.lengths[self.start : self.stop]

    @property
    def nbytes(self) -> int:
        """Memory of the whole store's caches (every row, at the capacity the longest row has grown it to)."""
        return sum(t.nbytes for cache in (self.store.keys, self.store.values) for t in cache)

    def rows(self, start: int, stop: int) -> KVState:
        if not 0 <= start < stop <= self.max_batch:
            raise IndexError(f"rows [{start}:{stop}] out of range for a state of {self.max_batch} rows")
        return KVState(self.store, self.start + start, self.start + stop)

    def gather_(self, dst_start: int, src_rows: torch.Tensor) -> KVState:
        n = src_rows.shape[0]
        if dst_start < 0 or dst_start + n > self.max_batch:
            raise IndexError(f"gather of {n} rows at {dst_start} overflows a state of {self.max_batch} rows")
        src = src_rows.to(self.device) + self.start
        dst = slice(self.start + dst_start, self.start + dst_start + n)
        if torch.equal(src, torch.arange(dst.start, dst.stop, device=self.device)):
            return self  # every row its own source (a resync after a round that kept row 0's node): no copy
        lengths = self.store.lengths.index_select(0, src)
        used = int(lengths.max())  # copy only the slots a source row holds (a host sync: this drafter is eager)
        for layer in (*self.store.keys, *self.store.values):
            layer[dst, :, :used] = layer[:, :, :used].index_select(0, src)
        self.store.lengths[dst] = lengths
        return self

    def reset_(self) -> KVState:
        self.lengths.zero_()
        return self

    def clone(self) -> KVState:
        s, rows = self.store, slice(self.start, self.stop)
        return KVState(KVStore([k[rows].clone() for k in s.keys], [v[rows].clone() for v in s.values],
                               s.lengths[rows].clone(), s.limit))
