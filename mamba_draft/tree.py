"""Draft-tree topology: `TreeConfig` (N1, ..., Nγ) and the parent-pointer `Tree` everything else derives from."""
from __future__ import annotations

import itertools
import operator
import re
from dataclasses import dataclass
from functools import cached_property

import torch

MAX_TREE_NODES = 1024  # draft nodes (root excluded); beyond this a tree forward stops being one cheap target call
_SPEC = re.compile(r" *[0-9]+ *(?:, *[0-9]+ *)*")  # "3,2,2,1,1", "3, 2": ASCII digits only, no empty fields


def equal_runs(values):
    """(start, stop) of each run of equal values."""
    stops = list(itertools.accumulate(len(list(run)) for _, run in itertools.groupby(values)))
    return zip([0, *stops], stops)


@dataclass(frozen=True)
class TreeConfig:
    """Static tree shape: every node at depth d has `branching[d]` children (depth 0 = root); a chain is
    `(1, ..., 1)`. `TreeConfig(())` (spec "none") is no speculation: the root alone, a plain decoding step."""

    branching: tuple[int, ...]

    def __post_init__(self) -> None:
        branching = tuple(self.branching)
        if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in branching):
            raise ValueError(f"TreeConfig branching factors must be positive integers, got {branching!r}")
        object.__setattr__(self, "branching", branching)
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"TreeConfig{branching} has {self.num_nodes} draft nodes, over the budget of "
                             f"{MAX_TREE_NODES}")

    @classmethod
    def parse(cls, spec: str | TreeConfig | tuple[int, ...] | list[int]) -> TreeConfig:
        """Build from `"3,2,2,1,1"` (spaces allowed around the numbers), `"none"` (no speculation), a tuple/list of
        ints, or pass a TreeConfig through; anything else is a ValueError."""
        if isinstance(spec, TreeConfig):
            return spec
        if isinstance(spec, str):
            if spec.strip().lower() == "none":
                return cls(())
            if not _SPEC.fullmatch(spec):
                what = f"tree spec {spec!r} is empty" if not spec.strip() else f"cannot parse tree spec {spec!r}"
                raise ValueError(f"{what}: expected comma-separated positive integers, e.g. '3,2,2,1,1', "
                                 "or 'none' (no speculation)")
            branching = tuple(int(p) for p in spec.split(","))
        elif isinstance(spec, (tuple, list)):
            if not spec:  # like "": no speculation is asked for by name
                raise ValueError(f"tree spec {spec!r} is empty: for no speculation pass 'none' or TreeConfig(())")
            branching = tuple(spec)
        else:
            raise ValueError(f"cannot parse tree spec {spec!r}: expected a string such as '3,2,2,1,1', "
                             "a tuple/list of positive ints or a TreeConfig")
        try:
            return cls(branching)
        except ValueError as err:  # zero, too many nodes, ...: say which spec the user gave
            raise ValueError(f"tree spec {spec!r}: {err}") from None

    @property
    def depth(self) -> int:
        """γ, the draft length (number of levels)."""
        return len(self.branching)

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """(B_1, ..., B_γ), B_i = N1·…·Ni."""
        return tuple(itertools.accumulate(self.branching, operator.mul))

    @property
    def num_nodes(self) -> int:
        """Draft nodes T = Σ B_i (root excluded)."""
        return sum(self.level_sizes)

    def __str__(self) -> str:
        return f"({self.spec})" if self.branching else "none"

    @property
    def spec(self) -> str:
        """The form `parse` reads back: "3,2,1", or "none" for no speculation."""
        return ",".join(map(str, self.branching)) or "none"

    def build(self) -> Tree:
        """The level-ordered parent-pointer tree for this shape."""
        parents, level = [-1], range(1)
        for n in self.branching:
            start = len(parents)
            parents.extend(parent for parent in level for _ in range(n))
            level = range(start, len(parents))
        return Tree(tuple(parents))


@dataclass(frozen=True)
class Tree:
    """A rooted tree as a parent-pointer array in level order: node 0 is the root (the last committed token,
    parent -1), every other node's parent has a smaller index and nodes of one level are contiguous."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("Tree.parents must start with the root's parent -1")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"Tree node {i} has parent {p}; parents must precede their children")
        if list(self.depths) != sorted(self.depths):
            raise ValueError("Tree nodes must be in level order (depth non-decreasing)")

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (root 0); the target sees node i at position P + depths[i]."""
        depths = [0]
        for p in self.parents[1:]:
            depths.append(depths[p] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return self.depths[-1]

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i] = node indices whose parent is i, in order (= the order they were drafted)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) node range of each depth 0..γ."""
        return tuple(equal_runs(self.depths))

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """(T+1, T+1) bool: mask[i, j] = j is i or an ancestor of i (what node i may attend to)."""
        mask = torch.eye(len(self.parents), dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """Every root-to-leaf path (root excluded), leaves in level order."""
        return tuple(tuple(self.path_to(i)) for i, kids in enumerate(self.children) if not kids and i > 0)


@dataclass(frozen=True)
class Forest:
    """`batch` copies of one `Tree` in one row space, level-major, for drafting B prompts at once: level l of all
    trees is the contiguous range [B*start_l, B*stop_l) (one drafter step), ordered by batch row, then as in the tree."""

    tree: Tree
    batch: int

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"a Forest needs a positive integer batch, got {self.batch!r}")

    def __len__(self) -> int:
        return self.batch * len(self.tree)

    @cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) row range of each depth 0..γ, all B trees together."""
        return tuple((self.batch * start, self.batch * stop) for start, stop in self.tree.levels)

    @cached_property
    def rows(self) -> torch.Tensor:
        """(B, T+1) int64: rows[b, i] = the forest row of node i (single-tree numbering) of batch row b."""
        rows = torch.empty(self.batch, len(self.tree), dtype=torch.long)
        batch = torch.arange(self.batch)[:, None]
        for start, stop in self.tree.levels:
            rows[:, start:stop] = self.batch * start + batch * (stop - start) + torch.arange(stop - start)
        return rows

    @cached_property
    def parent_rows(self) -> tuple[torch.Tensor, ...]:
        """Per level 1..γ, (B·B_l,) int64: the forest row of each of the level's rows' parent, in row order."""
        parents = torch.tensor(self.tree.parents)
        return tuple(self.rows.gather(1, parents[start:stop].expand(self.batch, -1)).reshape(-1)
                     for start, stop in self.tree.levels[1:])
