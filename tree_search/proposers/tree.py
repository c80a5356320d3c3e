"""`TreeProposer`: the drafter's trees (`tree_drafter.TreeDrafter`) proposed for rounds.

Rounds it did not propose (plain steps, lookup rounds) leave the drafter alone: their committed tokens wait
(`behind`) and its next round feeds them in one drafter call (rows 0..B-1 still hold the state after the last token
each read: drafting forks other rows, and only resync / extend move them). The drafter reads the prompts when it first
drafts (`prepare`), not before: a call whose policy never drafts never runs it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mamba_draft.tree import TreeConfig
from tree_search.proposers.base import Proposer, Round
from tree_search.sampling import SamplingParams
from tree_search.tree_drafter import DraftTree, TreeDrafter

if TYPE_CHECKING:
    from tree_search.calls import Call


class TreeProposer(Proposer):
    def __init__(self, drafts: TreeDrafter, params: SamplingParams | None, mode: str, record_probs: bool) -> None:
        self.drafts, self.params, self.mode, self.record_probs = drafts, params, mode, record_probs
        self.first_call = drafts.calls  # the TreeDrafter lives across calls: count this call's only
        self.calls_saved = 0
        self.logits: torch.Tensor | None = None  # (B, V) the drafter's logits after each root; None before prefill
        self.behind: list[torch.Tensor] = []  # (B, m) committed tokens the drafter has not read

    @property
    def calls(self) -> int:
        return self.drafts.calls - self.first_call

    @property
    def state_bytes(self) -> int:
        return self.drafts.state.nbytes if self.logits is not None else 0

    def prepare(self, call: Call) -> None:
        if self.logits is None:
            self.logits = self.drafts.prefill(call.ids[call.active], call.mask[call.active])

    def propose(self, arm: TreeConfig, roots: torch.Tensor, call: Call) -> DraftTree:
        """Every row's tree; row b draws its samples from call.generators[b] (None: torch's global RNG)."""
        self.catch_up()
        return self.drafts.draft(arm, roots, self.logits, self.params, self.mode, self.record_probs, call.generators)

    def catch_up(self) -> None:
        """After rounds that left the drafter alone: read the tokens they committed (ending with the root)."""
        if self.behind:
            tokens, self.behind = torch.cat(self.behind, dim=1), []
            self.logits = self.extend(tokens)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drafts.extend(tokens)

    def accept(self, round_: Round) -> None:
        if round_.proposer is self:  # the drafter's logits after each row's committed path and next token
            self.logits = self.resync(round_)
        else:
            single = all(len(row) == 1 for row in round_.proposed)  # a plain step's: already on the device
            self.behind.append(round_.next_tokens[:, None] if single else
                               torch.tensor(round_.proposed, device=round_.next_tokens.device))
        if round_.keep is not None:
            self.drafts.compact(round_.keep)
            self.behind = [tokens[round_.keep] for tokens in self.behind]
            self.logits = self.logits[round_.keep] if self.logits is not None else None

    def resync(self, round_: Round) -> torch.Tensor:
        return self.drafts.resync(round_.draft, [r.path[-1] if r.path else 0 for r in round_.results],
                                  [p[-1] for p in round_.proposed])
