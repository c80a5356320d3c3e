"""`Draft`: what every proposer returns for the target to verify (`proposers.base.Proposer.propose`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mamba_draft.tree import Tree


@dataclass
class Draft:
    """Each row's proposed tokens in the tree's node order, the roots first, and where recorded the distribution each
    node's children came from (what lossless sampling tests them against; a point mass for a given token)."""

    tokens: torch.Tensor  # (B, T+1) token at each node; tokens[:, 0] = the roots
    tree: Tree  # the T+1 nodes' topology (a root-only tree: a plain decoding step)
    probs: torch.Tensor | None  # (B, T+1, V_target) per node, its children's draft distribution; None: not recorded
