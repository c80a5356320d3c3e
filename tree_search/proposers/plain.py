"""`none`: nothing proposed. The round verifies each row's root alone: a plain decoding step."""
from __future__ import annotations

import torch

from mamba_draft.targets.cache import ROOT_ONLY
from tree_search.draft import Draft
from tree_search.proposers.base import Proposer


class PlainStep(Proposer):
    def propose(self, arm, roots: torch.Tensor, call) -> Draft:
        return Draft(roots[:, None], ROOT_ONLY, None)
