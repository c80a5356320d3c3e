"""Proposers: everything that proposes a round's tokens for the target to verify, behind one small interface.

    plain.PlainStep            `none`: nothing proposed, each row's root alone (a plain decoding step)
    tree.TreeProposer          the drafter's trees (Mamba or Transformer), one batched drafter step per level
    target_aware.TargetAwareProposer   trees of a drafter that reads the target's states of committed tokens
    lookup_chain.LookupChainProposer   the drafter's greedy chains in fewer calls (FLy's prompt lookup), one prompt
    ngram.NgramProposer        prompt-lookup rounds: the tokens that followed the context's last n-gram, one prompt

A round reads select -> `prepare` -> `propose` -> verify -> commit -> `accept` (`tree_search.generate`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from mamba_draft.targets.facts import target_vocab_size
from mamba_draft.tree import TreeConfig
from tree_search.draft import Draft
from tree_search.proposers.base import Proposer, Round
from tree_search.proposers.lookup_chain import LookupChainProposer
from tree_search.proposers.ngram import NgramProposer
from tree_search.proposers.plain import PlainStep
from tree_search.proposers.target_aware import TargetAwareProposer
from tree_search.proposers.tree import TreeProposer
from tree_search.tree_drafter import LOOKUP_ROWS

if TYPE_CHECKING:
    from tree_search.calls import Call
    from tree_search.policy import TreePolicy

__all__ = ["Draft", "Pick", "Proposer", "Proposers", "Round", "drafter_proposer"]


class Pick(NamedTuple):
    """A round's choice: who proposes, the policy's arm it is charged to, the tree shape to draft (None: the proposer
    knows its own, a lookup's chain)."""

    proposer: Proposer
    arm: int
    shape: TreeConfig | None


class Proposers:
    """One call's proposers: the plain step, the drafter's (when the policy has a drafted arm), and n-gram lookup
    rounds (one prompt, `lookup_tokens` > 0). `select` picks a round's: a lookup round when the context's last n-gram
    recurs and the policy finds its tokens worth verifying, else the policy's arm."""

    def __init__(self, decoder, call: Call, widest: int) -> None:
        self.plain = PlainStep()
        self.drafted = (drafter_proposer(decoder, call, widest) if any(arm.depth for arm in decoder.policy.arms)
                        else None)
        self.lookup = (NgramProposer(call, call.plan.records_probs, target_vocab_size(decoder.target))
                       if call.lookup_tokens else None)
        self.all = [p for p in (self.plain, self.drafted, self.lookup) if p is not None]
        self.reads_target = any(p.reads_target for p in self.all)

    def select(self, policy: TreePolicy) -> Pick:
        if self.lookup is not None and self.lookup.offer(policy):
            return Pick(self.lookup, policy.lookup_arm, None)
        arm = policy.select()
        shape = policy.arms[arm]
        return Pick(self.drafted if shape.depth else self.plain, arm, shape)

    def accept(self, round_: Round) -> None:
        for proposer in self.all:
            proposer.accept(round_)

    def drafter_stats(self) -> dict[str, int]:
        """What the call's stats report of the drafter."""
        drafted = self.drafted
        return ({"drafter_calls": drafted.calls, "drafter_calls_saved": drafted.calls_saved,
                 "drafter_state_bytes": drafted.state_bytes} if drafted is not None else {})


def drafter_proposer(decoder, call: Call, widest: int) -> TreeProposer:
    """The call's drafted proposer on the decoder's TreeDrafter (kept across its calls), `widest` state rows per
    prompt."""
    drafter, record_probs = decoder.drafter, call.plan.records_probs
    rows, out_vocab = call.batch * widest, target_vocab_size(decoder.target)
    if decoder.options.prompt_lookup:
        if drafter.reads_target:
            raise ValueError("prompt_lookup drafts chains on scratch rows without target states; a drafter that "
                             "reads the target takes tree shapes (and lookup_tokens rounds) instead")
        return LookupChainProposer(decoder.tree_drafter(max(rows, LOOKUP_ROWS), out_vocab), record_probs,
                                   capacity=call.ids.shape[1] + call.max_new_tokens)
    kind = TargetAwareProposer if drafter.reads_target else TreeProposer
    return kind(decoder.tree_drafter(rows, out_vocab), call.plan.sampling, call.plan.draft_mode, record_probs)
