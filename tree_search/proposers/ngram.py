"""Prompt-lookup rounds (`lookup_tokens` K > 0, one prompt): the tokens that followed the latest earlier occurrence
of the context's last n-gram, verified directly, as many as pay on this machine (`TreePolicy.lookup_length`)."""
from __future__ import annotations

import torch

from tree_search.proposers.tree import DraftTree, TreeDrafter
from tree_search.prompt_lookup import NgramLookup


class NgramProposer:
    reads_target = False

    def __init__(self, drafts: TreeDrafter, call, record_probs: bool) -> None:
        self.drafts, self.record_probs = drafts, record_probs  # drafts: the chain buffers it fills
        self.lookup = NgramLookup(call.ids[0].tolist(), call.lookup_tokens)
        self.offered: list[int] = []

    def offer(self, policy) -> bool:
        """Whether this round is a lookup round: the context's last n-gram recurs and its tokens pay."""
        tokens = self.lookup.propose()
        self.offered = tokens[: policy.lookup_length(len(tokens))] if tokens else []
        return bool(self.offered)

    def prepare(self, call) -> None:
        pass

    def propose(self, arm, roots: torch.Tensor, call) -> DraftTree:
        call.stats.lookup_rounds += 1
        return self.drafts.proposal(roots[:1], self.offered, self.record_probs)

    def accept(self, round_) -> None:
        self.lookup.extend(round_.committed[0])
