"""Lossy verification as acceptance rules over root-to-leaf paths, OR-ed with exact matching.

The target's own choice at each node is its argmax (greedy) or one sample of its processed distribution, drawn once
per node. A path node is *natively* accepted when its token equals the target's choice at its parent; a rule may
also accept mismatching nodes (`lossy_mask`). The longest accepted path prefix wins (ties: fewest lossy accepts, then
tree order), and the next token is the target's choice at its last node: exact for the new context, as the tree
forward already had the draft tokens in it. With a rule that never fires this is the greedy (or naive-sampling) rule.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import lru_cache

import torch

from mamba_draft.tree import Tree
from tree_search.sampling import choose
from tree_search.verifiers.base import Verifier, VerifyInput, VerifyResult


@dataclass
class Paths:
    """Root-to-leaf paths of one verified tree, with the target's own choices."""

    nodes: torch.Tensor  # (P, D) node at each depth of each path, -1 past the leaf
    parents: torch.Tensor  # (P, D) parent of each path node (the root, 0, at depth 0); 0 past the leaf
    valid: torch.Tensor  # (P, D) bool, False past the leaf
    choice: torch.Tensor  # (T+1,) the target's own next token after each node
    native: torch.Tensor  # (P, D) bool: the node's token equals the target's choice at its parent
    node_parents: torch.Tensor  # (T+1,) parent of every node (the root's own entry is 0)

    def on_paths(self, node_values: torch.Tensor) -> torch.Tensor:
        """Gather per-node values (T+1, ...) onto the path grid (P, D, ...); padding reads node 0."""
        return node_values[self.nodes.clamp(min=0)]


@lru_cache(maxsize=64)
def _path_grid(tree: Tree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nodes, parents) grids of a tree's leaf paths and its per-node parents, built once per tree and device."""
    leaf_paths = tree.leaf_paths or ((),)  # a root-only tree has one empty path
    depth = max(1, *(len(p) for p in leaf_paths))  # ... padded to one invalid column, so every gather has a column
    nodes = torch.full((len(leaf_paths), depth), -1, dtype=torch.long)
    for i, path in enumerate(leaf_paths):
        nodes[i, : len(path)] = torch.tensor(path, dtype=torch.long)
    parents = torch.cat([torch.zeros(len(leaf_paths), 1, dtype=torch.long), nodes[:, :-1].clamp(min=0)], dim=1)
    node_parents = torch.tensor(tree.parents, dtype=torch.long).clamp(min=0)
    return nodes.to(device), parents.to(device), node_parents.to(device)


def build_paths(inp: VerifyInput) -> Paths:
    """Lay the tree out as root-to-leaf paths and mark the natively accepted (exactly matching) nodes."""
    nodes, parents, node_parents = _path_grid(inp.tree, inp.tokens.device)
    valid = nodes >= 0
    choice = choose(inp.target_logits, inp.sampling, inp.generator)  # one draw per node when sampling
    native = (inp.tokens[nodes.clamp(min=0)] == choice[parents]) & valid
    return Paths(nodes, parents, valid, choice, native, node_parents)


def accept_longest(paths: Paths, lossy: dict[str, torch.Tensor]) -> VerifyResult:
    """Longest path prefix whose nodes each match natively or are accepted by some rule in `lossy` (name -> (P, D)).

    Counts lossy acceptances on the chosen prefix per rule (a node accepted by two rules counts for both).
    """
    accepted = torch.stack([paths.native, *lossy.values()]).any(dim=0) & paths.valid
    prefix = accepted.long().cumprod(dim=1)
    length = prefix.sum(dim=1)
    lossy_count = (prefix.bool() & ~paths.native).sum(dim=1)
    score = length * (paths.nodes.shape[1] + 1) - lossy_count  # longest, then fewest lossy accepts
    best = score.argmax()  # first maximum = earliest path in tree order
    on_path = prefix[best].bool() & ~paths.native[best]
    deepest = paths.nodes[best].gather(0, (length[best] - 1).clamp(min=0).view(1))
    last = torch.where(length[best] > 0, deepest, torch.zeros_like(deepest))  # the root when nothing was accepted
    counts = [(mask[best] & on_path).sum() for mask in lossy.values()]
    summary = torch.stack([length[best], lossy_count[best], paths.choice[last][0], *counts])
    n, lossy_accepts, next_token, *by_rule = summary.tolist()  # the round's one host sync (plus the path row)
    return VerifyResult(paths.nodes[best, :n].tolist(), next_token, lossy_accepts,
                        {"lossy_accepts_by": dict(zip(lossy, by_rule))})


class LossyVerifier(Verifier):
    """Base of the lossy verifiers: exact matching OR-ed with one acceptance rule (`lossy_mask`)."""

    lossless = False
    draft_mode = "topk"

    @abc.abstractmethod
    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        """(P, D) bool: path nodes this rule accepts even if they differ from the target's choice."""

    def verify(self, inp: VerifyInput) -> VerifyResult:
        paths = build_paths(inp)
        return accept_longest(paths, {self.name: self.lossy_mask(inp, paths) & paths.valid})
