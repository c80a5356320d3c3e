"""The interface every proposer implements (`Proposer`, returning a `draft.Draft`) and the round it reads after
verification (`Round`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from mamba_draft.tree import TreeConfig
from tree_search.draft import Draft

if TYPE_CHECKING:
    from tree_search.calls import Call
    from tree_search.verifiers import VerifyResult


@dataclass
class Round:
    """What a round verified and committed, as every proposer's `accept` reads it."""

    draft: Draft  # what was verified
    proposer: Proposer  # who proposed it
    results: list[VerifyResult]
    proposed: list[list[int]]  # per row: its accepted path's tokens and its next token
    committed: list[list[int]]  # per row: what joined its output (`proposed` cut at EOS / the budget)
    next_tokens: torch.Tensor  # (B,) each row's next token, on the device: the next round's roots
    hidden: torch.Tensor | None  # (B, T+1, H) the target's final states over the draft (when a proposer reads them)
    keep: list[int] | None  # the rows that go on (None: all)


class Proposer(Protocol):
    """Subclasses inherit the defaults: no preparation, and rounds read by nothing."""

    reads_target: bool = False  # `accept` needs the target's states of the round (`Round.hidden`)

    def prepare(self, call: Call) -> None:
        """Work owed before this proposer's first round (a prefill), charged to no round."""

    def propose(self, arm: TreeConfig | None, roots: torch.Tensor, call: Call) -> Draft: ...

    def accept(self, round_: Round) -> None: ...
