"""`none`: nothing proposed. The round verifies each row's root alone: a plain decoding step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mamba_draft.targets.cache import ROOT_ONLY
from mamba_draft.tree import Tree


@dataclass
class PlainDraft:
    tokens: torch.Tensor  # (B, 1) the roots
    tree: Tree = ROOT_ONLY
    probs: torch.Tensor | None = None


class PlainStep:
    reads_target = False

    def prepare(self, call) -> None:
        pass

    def propose(self, arm, roots: torch.Tensor, call) -> PlainDraft:
        return PlainDraft(roots[:, None])

    def accept(self, round_) -> None:
        pass
