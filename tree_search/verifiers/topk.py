"""Top-K acceptance (the Judge-decoding / AutoJudge baseline): accept a mismatching draft token in the target's top-K."""
from __future__ import annotations

import torch

from tree_search.verifiers.base import VerifyInput, register_verifier
from tree_search.verifiers.lossy import LossyVerifier, Paths


@register_verifier
class TopKVerifier(LossyVerifier):
    """Accept a draft token ranked within the target's top-K at its parent (raw logits). K = 1 ≡ greedy."""

    name = "topk"

    def __init__(self, k: int = 2) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"topk: K must be an integer >= 1, got {k!r}")
        self.k = k

    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        logits = inp.target_logits[paths.node_parents]  # each node's token ranked at its parent
        own = logits.gather(-1, inp.tokens.unsqueeze(-1))
        return paths.on_paths((logits > own).sum(-1) < self.k)  # fewer than K tokens score strictly higher
