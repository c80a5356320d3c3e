"""An n-gram table with backoff: the baseline a trained drafter must beat on the same data.

Counts the scored transitions of the training rows (context of up to n-1 tokens -> next token) and predicts the
most frequent continuation of the longest context seen, backing off to shorter ones and finally to the most
frequent scored token. A drafter that only matches this has learned n-gram statistics and no more.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import torch


class NGramTable:
    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.counts: list[defaultdict[tuple, Counter]] = [defaultdict(Counter) for _ in range(n)]  # per context size
        self._best: list[dict[tuple, int]] | None = None

    def fit(self, rows: Iterable[tuple[Sequence[int], Sequence[bool]]]) -> "NGramTable":
        """rows: (token ids, scored) pairs; every scored token t > 0 counts under each of its contexts."""
        for ids, scored in rows:
            ids = list(ids)
            for t in range(1, len(ids)):
                if scored[t]:
                    for k in range(min(self.n, t + 1)):
                        self.counts[k][tuple(ids[t - k:t])][ids[t]] += 1
        self._best = [{ctx: c.most_common(1)[0][0] for ctx, c in table.items()} for table in self.counts]
        return self

    def predict(self, ids: Sequence[int]) -> torch.Tensor:
        """(L,) the predicted next token after every prefix ids[:t+1] (position t predicts token t+1)."""
        if self._best is None:
            raise ValueError("fit the table first")
        fallback = self._best[0].get((), 0)
        out = []
        for t in range(len(ids)):  # the longest context seen wins
            hits = (self._best[k].get(tuple(ids[t + 1 - k:t + 1])) for k in range(min(self.n - 1, t + 1), 0, -1))
            out.append(next((hit for hit in hits if hit is not None), fallback))
        return torch.tensor(out, dtype=torch.long)
