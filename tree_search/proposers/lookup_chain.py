"""One prompt's greedy chains with FLy's prompt lookup: the same chain as `TreeProposer` drafts, in fewer drafter
calls (proposals checked in one call each). The committed text the lookup reads stays on the device, appended in
place each round."""
from __future__ import annotations

import torch

from mamba_draft.tree import TreeConfig
from tree_search.proposers.tree import TreeProposer
from tree_search.tree_drafter import DraftTree, TreeDrafter


class LookupChainProposer(TreeProposer):
    def __init__(self, drafts: TreeDrafter, record_probs: bool, capacity: int) -> None:
        super().__init__(drafts, None, "topk", record_probs)  # greedy chains: no sampling state
        self.capacity = capacity  # prompt + new tokens: the most the committed text can hold
        self.context: torch.Tensor | None = None
        self.length = 0

    def prepare(self, call) -> None:
        if self.logits is None:
            ids = call.ids[call.active]
            self.context = torch.empty(self.capacity, dtype=torch.long, device=ids.device)
            self.context[: ids.shape[1]] = ids[0]
            self.length = ids.shape[1]
        super().prepare(call)

    def propose(self, arm: TreeConfig, roots: torch.Tensor, call) -> DraftTree:
        self.catch_up()
        buf, lookup = self.drafts.draft_chain_lookup(arm, roots[:1], self.logits, self.context[: self.length],
                                                     self.record_probs)
        self.calls_saved += arm.depth - 1 - lookup.drafter_calls  # vs one step per non-leaf node
        return buf

    def resync(self, round_) -> torch.Tensor:
        draft = round_.draft
        self.calls_saved += len(round_.results[0].path) == draft.config.depth  # resync steps an accepted leaf too
        return self.extend(torch.tensor([round_.proposed[0]], device=self.context.device))

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row 0 reads committed tokens (1, m) -> the logits after them (1, V); they join the lookup's text."""
        row = tokens[0]
        self.context[self.length : self.length + len(row)] = row
        self.length += len(row)
        return super().extend(tokens)
