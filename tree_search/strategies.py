"""Drafting strategies: how `generate` fills a round's draft and resyncs the drafter after it, behind one interface.

`TreeDrafting` drafts the tree level by level (`TreeDrafter.draft`); `LookupDrafting` drafts chains at temperature 0
with prompt lookup (FLy's multi-level acceleration: the same greedy chain in fewer drafter calls when the text repeats).
Both have `prefill(ids) -> root logits`, `draft(config, root, root_logits) -> DraftTree`,
`resync(buf, result, proposed) -> next root logits`, `skip(tokens)` (a no-speculation round committed `tokens`),
`proposal(root, tokens)` (given tokens as a chain: prompt-lookup rounds, which commit through `skip`), `root` (the
next round's root token, on the device), `calls` (drafter calls since construction) and `calls_saved`
(vs drafting every chain step by step).

No-speculation rounds (the `none` arm) and prompt-lookup rounds leave the drafter alone: the tokens they commit wait in `behind` and the next
drafted round feeds them in one `resync_extend` call (row 0 still holds the state after the last token the drafter
read, since drafting forks rows 1.. and only `resync` / `resync_extend` move row 0), instead of one step per round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tree_search.drafting import LOOKUP_ROWS, TreeDrafter

if TYPE_CHECKING:
    from tree_search.drafting import DraftTree
    from tree_search.sampling import SamplingParams
    from tree_search.tree import TreeConfig
    from tree_search.verifiers import VerifyResult


class TreeDrafting:
    """The drafter's tree: top-N (or sampled) children per node, one batched drafter step per level."""

    def __init__(self, drafts: TreeDrafter, params: SamplingParams, mode: str, record_probs: bool,
                 generator: torch.Generator | None) -> None:
        self.drafts, self.params, self.mode, self.record_probs, self.generator = (
            drafts, params, mode, record_probs, generator)
        self.first_call = drafts.calls  # the TreeDrafter is shared across calls: count this call's only
        self.calls_saved = 0
        self.behind: list[int] = []  # committed tokens the drafter has not read yet (no-speculation rounds)

    @property
    def calls(self) -> int:
        return self.drafts.calls - self.first_call

    @property
    def root(self) -> torch.Tensor:
        return self.drafts.one_token[0]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drafts.prefill(ids)

    def draft(self, config: TreeConfig, root: torch.Tensor, root_logits: torch.Tensor) -> DraftTree:
        root_logits = self.caught_up(root_logits)
        return self.drafts.draft(config, root, root_logits, self.params, self.mode, self.record_probs, self.generator)

    def proposal(self, root: torch.Tensor, tokens: list[int]) -> DraftTree:
        """A chain of given tokens (prompt lookup) to verify instead of a draft; its committed tokens go to `skip`."""
        return self.drafts.proposal(root, tokens, self.record_probs)

    def resync(self, buf: DraftTree, result: VerifyResult, proposed: list[int]) -> torch.Tensor:
        return self.drafts.resync(buf, result.path, result.next_token)

    def skip(self, tokens: list[int]) -> None:
        """A round committed `tokens` without drafting; the drafter reads them when it next drafts."""
        self.behind += tokens

    def caught_up(self, root_logits: torch.Tensor | None) -> torch.Tensor:
        """The drafter's logits after the root: `root_logits`, or, after no-speculation rounds, those of feeding it
        the tokens they committed (ending with the root) in one call."""
        if not self.behind:
            return root_logits
        tokens, self.behind = torch.tensor(self.behind, device=self.drafts.device), []
        return self.extend(tokens)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row 0 (the state after the last token read) reads committed `tokens` (1-D) -> the logits after them."""
        return self.drafts.resync_extend(tokens)


class LookupDrafting(TreeDrafting):
    """The drafter's greedy chain, with prompt-lookup proposals checked in one drafter call each (chains, greedy).

    Keeps the committed text on the device for the lookup, appended in place each round (no per-round rebuild).
    """

    def __init__(self, drafts: TreeDrafter, record_probs: bool, capacity: int) -> None:
        super().__init__(drafts, None, "topk", record_probs, None)  # greedy chains: no sampling state
        self.capacity = capacity  # prompt + new tokens: the most the committed text can hold
        self.context = None
        self.length = 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.context = torch.empty(self.capacity, dtype=torch.long, device=ids.device)
        self.context[: ids.shape[1]] = ids[0]
        self.length = ids.shape[1]
        return super().prefill(ids)

    def draft(self, config: TreeConfig, root: torch.Tensor, root_logits: torch.Tensor) -> DraftTree:
        root_logits = self.caught_up(root_logits)  # first, so the lookup searches the whole committed text
        buf, lookup = self.drafts.draft_chain_lookup(config, root, root_logits, self.context[: self.length],
                                                     self.record_probs)
        self.calls_saved += config.depth - 1 - lookup.drafter_calls  # vs one step per non-leaf node
        return buf

    def resync(self, buf: DraftTree, result: VerifyResult, proposed: list[int]) -> torch.Tensor:
        self.calls_saved += len(result.path) == buf.config.depth  # `TreeDrafter.resync` steps an accepted leaf too
        return self.extend(torch.tensor(proposed, device=self.context.device))

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        self.context[self.length : self.length + len(tokens)] = tokens
        self.length += len(tokens)
        return super().extend(tokens)


def drafting_strategy(drafter, prompt_lookup: bool, rows: int, out_vocab: int, params: SamplingParams, mode: str,
                      record_probs: bool, generator: torch.Generator | None, max_tokens: int) -> TreeDrafting:
    """The call's strategy on the drafter's cached TreeDrafter. rows: state rows the largest tree needs;
    max_tokens: prompt + max_new_tokens (the longest committed text)."""
    if prompt_lookup:
        drafts = TreeDrafter.for_drafter(drafter, max(rows, LOOKUP_ROWS), out_vocab)
        return LookupDrafting(drafts, record_probs, max_tokens)
    return TreeDrafting(TreeDrafter.for_drafter(drafter, rows, out_vocab), params, mode, record_probs, generator)
