"""Exact-equality check of generated token ids against the target's own greedy output (Spec-Bench `equal.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tree_search.divergence import divergence as compare_tokens


@dataclass
class Equality:
    identical: bool                 # every output equals its reference token for token
    n_prompts: int
    n_identical: int
    divergence: list[int | None] = field(default_factory=list)  # per prompt: first differing token index, None if equal
    prefix_agreement: float = 1.0   # mean over prompts of (tokens before the first divergence) / reference length

    def summary(self) -> str:
        if self.identical:
            return f"identical ({self.n_identical}/{self.n_prompts})"
        first = next(i for i, d in enumerate(self.divergence) if d is not None)
        return (f"DIFFERS ({self.n_identical}/{self.n_prompts} identical; prompt {first} diverges at token "
                f"{self.divergence[first]}; prefix agreement {self.prefix_agreement:.2f})")


def compare_outputs(references: list[list[int]], candidates: list[list[int]]) -> Equality:
    """Compare each candidate output with the reference output for the same prompt."""
    if len(references) != len(candidates):
        raise ValueError(f"{len(candidates)} outputs for {len(references)} reference outputs")
    divergence = [compare_tokens(r, c).first_divergence for r, c in zip(references, candidates)]
    agreement = [1.0 if d is None else d / max(len(r), 1) for d, r in zip(divergence, references)]
    n_identical = sum(d is None for d in divergence)
    return Equality(identical=n_identical == len(references), n_prompts=len(references), n_identical=n_identical,
                    divergence=divergence, prefix_agreement=sum(agreement) / max(len(agreement), 1))
