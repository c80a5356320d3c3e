"""Drafting strategies: how `generate` fills a round's drafts for its B rows and resyncs the drafter after it.

No-speculation and prompt-lookup rounds leave the drafter alone: the tokens they commit wait (`behind`) and the next
drafted round feeds them in one drafter call (rows 0..B-1 still hold the state after the last token each read:
drafting forks other rows, and only resync / extend move them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mamba_draft.tree import TreeConfig
from tree_search.drafting import DraftTree, TreeDrafter

if TYPE_CHECKING:
    from tree_search.sampling import SamplingParams
    from tree_search.verifiers import VerifyResult


class TreeDrafting:
    """The drafter's trees: top-N (or sampled) children per node, one batched drafter step per level for all rows."""

    reads_target = False  # whether resync / skip need the target's states of the committed tokens (`features`)

    def __init__(self, drafts: TreeDrafter, params: SamplingParams, mode: str, record_probs: bool) -> None:
        self.drafts, self.params, self.mode, self.record_probs = drafts, params, mode, record_probs
        self.first_call = drafts.calls  # the TreeDrafter is shared across calls: count this call's only
        self.calls_saved = 0
        self.behind: list[torch.Tensor] = []  # (B, m) committed tokens the drafter has not read (none / lookup rounds)

    @property
    def calls(self) -> int:
        return self.drafts.calls - self.first_call

    def roots(self, batch: int) -> torch.Tensor:
        """Each row's next root token (B,), on the device."""
        return self.drafts.roots[:batch]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.drafts.prefill(ids, mask)

    def catch_up(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits after each root: `logits`, or, after rounds that left the drafter alone, those after
        the tokens they committed (ending with the root), fed in one call."""
        if not self.behind:
            return logits
        tokens, self.behind = torch.cat(self.behind, dim=1), []
        return self.extend(tokens)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drafts.extend(tokens)

    def draft(self, config: TreeConfig, logits: torch.Tensor, generators: list[torch.Generator] | None) -> DraftTree:
        """Every row's tree; row b draws its samples from generators[b] (None: torch's global RNG)."""
        return self.drafts.draft(config, self.roots(logits.shape[0]), logits, self.params, self.mode,
                                 self.record_probs, generators)

    def proposal(self, tokens: list[int]) -> DraftTree:
        """One prompt's chain of given tokens (prompt lookup) to verify instead of a draft; then `skip`."""
        return self.drafts.proposal(self.roots(1), tokens, self.record_probs)

    def resync(self, draft: DraftTree, results: list[VerifyResult], proposed: list[list[int]],
               features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The drafter's logits after each row's committed path and next token (`TreeDrafter.resync`). `features`:
        for a drafter that reads the target only."""
        return self.drafts.resync(draft, [r.path[-1] if r.path else 0 for r in results], [p[-1] for p in proposed])

    def skip(self, tokens: torch.Tensor, catch_up: bool = True, features: list[torch.Tensor] | None = None) -> None:
        """A round committed `tokens` (B, m) without drafting; the drafter reads them when it next drafts (if
        `catch_up`)."""
        self.drafts.roots[: tokens.shape[0]] = tokens[:, -1]
        if catch_up:
            self.behind.append(tokens)

    def compact(self, rows: list[int]) -> None:
        """Only rows `rows` go on (finished rows dropped)."""
        self.drafts.compact(rows)
        self.behind = [tokens[rows] for tokens in self.behind]


class TargetAwareDrafting(TreeDrafting):
    """Trees of a drafter that reads the target (`MambaDrafter.reads_target`): every committed token is read with
    the target's final hidden state before it (`features`, from the round's verification forward), while drafted
    tokens and the prompt read the drafter's learned stand-in. So a round's committed tokens are read again from
    each row's root state instead of keeping the drafted rows' states as `TreeDrafting.resync` does."""

    reads_target = True

    def __init__(self, drafts: TreeDrafter, params: SamplingParams, mode: str, record_probs: bool) -> None:
        super().__init__(drafts, params, mode, record_probs)
        self.pending: list[tuple[list[int], list[torch.Tensor]]] = []  # per row: tokens and features not yet read

    def resync(self, draft: DraftTree, results: list[VerifyResult], proposed: list[list[int]],
               features: list[torch.Tensor] | None = None) -> torch.Tensor:
        self.skip(proposed, True, features)
        return self.catch_up(None)

    def skip(self, tokens: list[list[int]], catch_up: bool = True, features: list[torch.Tensor] | None = None) -> None:
        """A round's committed tokens per row (host lists) and their target states."""
        self.drafts.roots[: len(tokens)] = torch.tensor([row[-1] for row in tokens], device=self.drafts.device)
        if not catch_up:
            return
        if features is None:
            raise ValueError("a drafter that reads the target needs the target's states for committed tokens")
        if not self.pending:
            self.pending = [([], []) for _ in tokens]
        for (pending_tokens, pending_features), row, feature in zip(self.pending, tokens, features):
            pending_tokens += row
            pending_features.append(feature)

    def catch_up(self, logits: torch.Tensor | None) -> torch.Tensor:
        if not self.pending:
            return logits
        rows, self.pending = self.pending, []
        return self.drafts.read([tokens for tokens, _ in rows], [torch.cat(features) for _, features in rows])

    def compact(self, rows: list[int]) -> None:
        self.drafts.compact(rows)
        self.pending = [self.pending[b] for b in rows] if self.pending else []


class LookupDrafting(TreeDrafting):
    """One prompt's greedy chains with FLy's prompt lookup (the same chain in fewer drafter calls: proposals checked in
    one call each); the committed text the lookup reads stays on the device, appended in place each round."""

    def __init__(self, drafts: TreeDrafter, record_probs: bool, capacity: int) -> None:
        super().__init__(drafts, None, "topk", record_probs)  # greedy chains: no sampling state
        self.capacity = capacity  # prompt + new tokens: the most the committed text can hold
        self.context = None
        self.length = 0

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.context = torch.empty(self.capacity, dtype=torch.long, device=ids.device)
        self.context[: ids.shape[1]] = ids[0]
        self.length = ids.shape[1]
        return super().prefill(ids, mask)

    def draft(self, config: TreeConfig, logits: torch.Tensor, generators=None) -> DraftTree:
        buf, lookup = self.drafts.draft_chain_lookup(config, self.roots(1), logits, self.context[: self.length],
                                                     self.record_probs)
        self.calls_saved += config.depth - 1 - lookup.drafter_calls  # vs one step per non-leaf node
        return buf

    def resync(self, draft: DraftTree, results: list[VerifyResult], proposed: list[list[int]],
               features: list[torch.Tensor] | None = None) -> torch.Tensor:
        self.calls_saved += len(results[0].path) == draft.config.depth  # a tree's resync steps an accepted leaf too
        return self.extend(torch.tensor([proposed[0]], device=self.context.device))

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row 0 reads committed tokens (1, m) -> the logits after them (1, V); they join the lookup's text."""
        row = tokens[0]
        self.context[self.length : self.length + len(row)] = row
        self.length += len(row)
        return super().extend(tokens)
