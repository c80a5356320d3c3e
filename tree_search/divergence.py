"""How far a lossy decode drifted from the lossless greedy output: first-divergence position and differing fraction."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    """Token-level comparison of one lossy output against the lossless reference output."""

    first_divergence: int | None  # index of the first differing token; None when the outputs are identical
    differing_fraction: float  # position-wise mismatches / longer length (missing positions count as differing)
    reference_length: int
    candidate_length: int

    @property
    def identical(self) -> bool:
        return self.first_divergence is None


def divergence(reference: Sequence[int], candidate: Sequence[int]) -> Divergence:
    """Compare `candidate` (lossy output tokens) with `reference` (greedy lossless output tokens), prompt excluded."""
    reference, candidate = [int(t) for t in reference], [int(t) for t in candidate]
    longest = max(len(reference), len(candidate))
    differs = [i >= len(reference) or i >= len(candidate) or reference[i] != candidate[i] for i in range(longest)]
    first = differs.index(True) if any(differs) else None
    fraction = sum(differs) / longest if longest else 0.0
    return Divergence(first, fraction, len(reference), len(candidate))


def summarize(divergences: Sequence[Divergence]) -> dict[str, float]:
    """Benchmark-level aggregate: share of identical outputs, mean first-divergence position (over the diverging
    outputs only, NaN when none diverged), mean differing fraction."""
    if not divergences:
        raise ValueError("summarize() needs at least one Divergence")
    diverged = [d.first_divergence for d in divergences if d.first_divergence is not None]
    return {
        "num_outputs": float(len(divergences)),
        "identical_fraction": 1.0 - len(diverged) / len(divergences),
        "mean_first_divergence": sum(diverged) / len(diverged) if diverged else float("nan"),
        "mean_differing_fraction": sum(d.differing_fraction for d in divergences) / len(divergences),
    }
