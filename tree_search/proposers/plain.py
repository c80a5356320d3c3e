"""`none`: nothing proposed. The round verifies each row's root alone: a plain decoding step."""
from __future__ import annotations

import torch

from mamba_draft.targets.cache import ROOT_ONLY
from tree_search.draft import Draft


class PlainStep:
    reads_target = False

    def prepare(self, call) -> None:
        pass

    def propose(self, arm, roots: torch.Tensor, call) -> Draft:
        return Draft(roots[:, None], ROOT_ONLY, None)

    def accept(self, round_) -> None:
        pass
