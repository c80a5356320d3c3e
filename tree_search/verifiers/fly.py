"""FLy (training-free loosely speculative decoding): entropy gate + deferred window over each root-to-leaf path.

A mismatch j on a path whose parent's target entropy is below θ is rejected; otherwise j is accepted only if the
next W draft tokens on that path match the target exactly (a window past the path rejects). Defaults θ=0.3, W=6
(the paper's). Entropy: the reference implementation's top-3 -Σ_{top3} p log p over the full softmax (natural log),
or `normalized`, the full entropy / log|V|; at T > 0 of the processed target distribution.
"""
from __future__ import annotations

import math

import torch

from tree_search.sampling import soft_probs
from tree_search.verifiers.base import VerifyInput, register_verifier
from tree_search.verifiers.lossy import LossyVerifier, Paths

ENTROPIES = ("top3", "normalized")


def target_entropy(probs: torch.Tensor, kind: str = "top3") -> torch.Tensor:
    """(N, V) distributions -> (N,) entropies: top-3 (reference FLy) or "normalized", full entropy / log|V|."""
    if kind == "top3":
        return torch.special.entr(probs.topk(min(3, probs.shape[-1]), dim=-1).values).sum(-1)
    return torch.special.entr(probs).sum(-1) / math.log(probs.shape[-1])


def fly_mask(native: torch.Tensor, valid: torch.Tensor, entropy: torch.Tensor, theta: float, window: int) -> torch.Tensor:
    """(P, D) mismatches FLy accepts: entropy >= θ and the next `window` path nodes all match natively.

    native / valid / entropy are (P, D) over path positions; entropy is that of the distribution that chose
    the node (its parent's). A window running past the path end contains padding, which never matches.
    """
    matched = native & valid
    following = torch.cat([matched[:, 1:], matched.new_zeros(len(matched), window)], dim=1)  # (P, D-1+W)
    window_clean = following.unfold(1, window, 1).all(dim=-1)  # (P, D): positions d+1..d+W all matched
    return ~native & valid & (entropy >= theta) & window_clean


@register_verifier
class FLyVerifier(LossyVerifier):
    """FLy's loose verification, `lossless = False`. θ = inf rejects every mismatch (≡ greedy)."""

    name = "fly"

    def __init__(self, theta: float = 0.3, window: int = 6, entropy: str = "top3") -> None:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or math.isnan(theta) or theta < 0:
            raise ValueError(f"fly: entropy threshold theta must be a number >= 0 (inf = never loosen), got {theta!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"fly: window W must be an integer >= 1, got {window!r}")
        if entropy not in ENTROPIES:
            raise ValueError(f"fly: unknown entropy {entropy!r}; choose one of {ENTROPIES}")
        self.theta, self.window, self.entropy = float(theta), window, entropy

    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        probs = soft_probs(inp.target_logits, inp.sampling)
        entropy = target_entropy(probs, self.entropy)[paths.parents]  # of the distribution each node was judged by
        return fly_mask(paths.native, paths.valid, entropy, self.theta, self.window)
