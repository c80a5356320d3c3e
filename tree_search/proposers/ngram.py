"""Prompt-lookup rounds (`lookup_tokens` K > 0, one prompt): the tokens that followed the latest earlier occurrence
of the context's last n-gram, verified directly, as many as pay on this machine (`TreePolicy.lookup_length`)."""
from __future__ import annotations

import torch

from mamba_draft.tree import Tree, TreeConfig
from tree_search.draft import Draft
from tree_search.prompt_lookup import NgramLookup
from tree_search.proposers.base import Proposer


class NgramProposer(Proposer):
    """Its own buffers: one row of K + 1 tokens and, where the call records them, their point-mass distributions
    (lossless sampling then accepts a looked-up token with the target's probability); no drafter call."""

    def __init__(self, call, record_probs: bool, out_vocab: int) -> None:
        self.lookup = NgramLookup(call.ids[0].tolist(), call.lookup_tokens)
        self.offered: list[int] = []
        device, width = call.ids.device, call.lookup_tokens + 1
        self.tokens = torch.zeros(1, width, dtype=torch.long, device=device)
        self.probs = torch.zeros(1, width, out_vocab, device=device) if record_probs else None
        self.chains: dict[int, Tree] = {}  # per length, the chain's tree

    def offer(self, policy) -> bool:
        """Whether this round is a lookup round: the context's last n-gram recurs and its tokens pay."""
        tokens = self.lookup.propose()
        self.offered = tokens[: policy.lookup_length(len(tokens))] if tokens else []
        return bool(self.offered)

    def propose(self, arm, roots: torch.Tensor, call) -> Draft:
        """The offered tokens as a chain after the prompt's root (roots: (B,), B = 1)."""
        call.stats.lookup_rounds += 1
        n = len(self.offered)
        if n not in self.chains:
            self.chains[n] = TreeConfig((1,) * n).build()
        tokens = self.tokens[:, : n + 1]
        tokens[:, 0] = roots[:1]
        tokens[0, 1:] = torch.tensor(self.offered, device=tokens.device)
        probs = None
        if self.probs is not None:
            probs = self.probs[:, : n + 1]
            probs[0, :-1].zero_().scatter_(1, tokens[0, 1:, None], 1.0)
        return Draft(tokens, self.chains[n], probs)

    def accept(self, round_) -> None:
        self.lookup.extend(round_.committed[0])
