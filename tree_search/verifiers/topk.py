"""Top-K acceptance (the Judge-decoding / AutoJudge baseline): accept a mismatching draft token in the target's top-K."""
from __future__ import annotations

import torch

from tree_search.verifiers.base import VerifyInput, register_verifier
from tree_search.verifiers.lossy import LossyVerifier, Paths


def in_top_k(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """(N, V) logits, (N,) tokens -> (N,) bool: fewer than k tokens score strictly higher than `tokens`."""
    own = logits.gather(-1, tokens.unsqueeze(-1))
    return (logits > own).sum(-1) < k


@register_verifier
class TopKVerifier(LossyVerifier):
    """Accept a draft token ranked within the target's top-K at its parent (raw logits). K = 1 ≡ greedy."""

    name = "topk"

    def __init__(self, k: int = 2) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"topk: K must be an integer >= 1, got {k!r}")
        self.k = k

    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        ranked_ok = in_top_k(inp.target_logits[paths.node_parents], inp.tokens, self.k)
        return paths.on_paths(ranked_ok)
