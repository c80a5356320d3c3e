"""Trees of a drafter that reads the target (`MambaDrafter.reads_target`): every committed token is read with the
target's final hidden state before it (from the round's verification forward), while drafted tokens and the prompt
read the drafter's learned stand-in. So a round's committed tokens are read again from each row's root state, rather
than kept from the drafted rows' states as `TreeProposer.resync` does."""
from __future__ import annotations

import torch

from tree_search.proposers.tree import TreeProposer


class TargetAwareProposer(TreeProposer):
    reads_target = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[list[int], list[torch.Tensor]]] = []  # per row: tokens and states not yet read

    def accept(self, round_) -> None:
        """Queue each row's committed tokens with the target's states before them (the root's and the accepted
        nodes'); the round's own proposer reads them at once, the others when they next draft."""
        if not self.pending:
            self.pending = [([], []) for _ in round_.proposed]
        for b, ((tokens, states), row, result) in enumerate(zip(self.pending, round_.proposed, round_.results)):
            tokens += row
            states.append(round_.hidden[b, [0, *result.path]])
        if round_.proposer is self:
            self.catch_up()
        if round_.keep is not None:
            self.drafts.compact(round_.keep)
            self.pending = [self.pending[b] for b in round_.keep] if self.pending else []
            self.logits = self.logits[round_.keep] if self.logits is not None else None

    def catch_up(self) -> None:
        if self.pending:
            rows, self.pending = self.pending, []
            self.logits = self.drafts.read([tokens for tokens, _ in rows], [torch.cat(states) for _, states in rows])
