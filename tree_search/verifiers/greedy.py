"""`greedy`: exact match with the target argmax along the tree (temperature 0, lossless)."""
from __future__ import annotations

import torch

from mamba_draft.tree import Tree
from tree_search.verifiers.base import Verifier, VerifyInput, VerifyResult, register_verifier


def greedy_walk(tree: Tree, tokens: list[int], target_choice: list[int]) -> VerifyResult:
    """Follow the child whose token equals the target's choice at each node -> the path and the target's choice after
    it; siblings carry distinct tokens, so at most one child matches."""
    node, path = 0, []
    while True:
        want = target_choice[node]
        match = next((c for c in tree.children[node] if tokens[c] == want), None)
        if match is None:
            return VerifyResult(path, want)
        path.append(match)
        node = match


@register_verifier
class GreedyVerifier(Verifier):
    """Longest path where every draft token equals the target argmax, plus the target's argmax after it."""

    name = "greedy"
    lossless = True
    draft_mode = "topk"
    greedy_only = True

    def walks_argmax(self, sampling) -> bool:
        return type(self).verify is GreedyVerifier.verify  # a subclass that decides otherwise is asked per row

    def verify(self, inp: VerifyInput) -> VerifyResult:
        # One host sync per round: the walk below is Python control flow over a few dozen nodes.
        return greedy_walk(inp.tree, inp.tokens.tolist(), torch.argmax(inp.target_logits, dim=-1).tolist())
