"""Arms from the cost curve: which tree shapes `auto`'s bandit chooses among on this machine, with this drafter.

A round of shape a (depth γ, T draft nodes) drafts γ levels, verifies T + 1 tokens per row in one target forward and
commits τ(a) tokens per row. Relative to plain decoding (one token per forward) it runs at

    S(a) = E[τ(a)] · v(B) / (v(B·(T + 1)) + γ·d)

v(n) the seconds of one target forward over n tokens (B rows, measured on this machine by `measure_verify_costs`),
d the seconds of one drafter level (measured on the rounds drafted so far), and E[τ] from the drafter's acceptance
by rank: p_k the chance that the target's next token is the drafter's k-th proposal, q(b) = p_1 + … + p_b the chance
that one of b children is accepted, E[τ] = 1 + Σ_i q(b_1)·…·q(b_i) (greedy verification, ranks independent of
depth). Where verification is flat (a GPU, a bf16-native CPU) wide and deep trees score best; where every token
verified costs (an AVX2 CPU) short chains do, or nothing. The bandit then pulls among `none` and the
`PLANNED_ARMS` best-scoring shapes and learns which really pays; the acceptance and draft cost it observes re-plan
the arms at the start of each call and every `REPLAN_ROUNDS` rounds. A prompt-lookup round is a chain without
drafter cost: it verifies the length of best S under the lookups' own acceptance, or does not run.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from mamba_draft.tree import Tree, TreeConfig
from tree_search.bandit import UCBBandit

# The shapes `auto` plans from: chains, small trees for steep cost curves, the paper's trees for flat ones.
CANDIDATES = tuple(TreeConfig.parse(s) for s in (
    "none", "1", "1,1", "1,1,1", "1,1,1,1", "1,1,1,1,1", "1,1,1,1,1,1", "2", "2,1", "2,1,1", "2,1,1,1", "3,1,1",
    "2,2,1", "2,2,1,1", "3,2,1,1", "3,2,2,1,1", "2,2,2,1,1,1", "3,3,2,1"))
PLANNED_ARMS = 3  # shapes the bandit pulls besides `none`
# a shape predicted below this share of plain decoding's speed is not pulled at all (the prior acceptance is a guess,
# so shapes near break-even are still tried): where every shape scores below it (a steep CPU and a batch of rows),
# `auto` decodes plainly instead of paying to explore shapes that cannot win
PLAN_FLOOR = 0.8
# Before any round is seen: a drafter's top proposal is the target's token about half the time on chat replies
# (the shipped drafter's chain of 3 commits τ 1.77 on even-id questions: p_1 ≈ 0.45), its second and third less
# often; PRIOR_WEIGHT pseudo-trials, so a few calls' rounds outweigh it.
PRIOR_RANKS = (0.5, 0.1, 0.05, 0.03)
PRIOR_WEIGHT = 8.0
PRIOR_DRAFT_LEVEL = 0.25  # a drafter level, in target tokens, until a drafted round is measured
PRIOR_LOOKUP = 0.6  # how often a prompt-lookup token is accepted after the ones before it, before any is verified
# the probe stops doubling once a forward costs this many single-token forwards (then: linear; SmolLM2 on the AVX2
# kind reaches it at 16 tokens)
STEEP = 3.0


@dataclass
class VerifyCosts:
    """Seconds of one target forward over n tokens (all rows together) at the probed n; linear in between and,
    past the last probe, along the last two probes' slope (compute-bound forwards grow linearly). `covers`: the
    widest forward it answers for (unbounded once the probes reached the linear, `STEEP` part)."""

    seconds: dict[int, float]
    covers: float

    def __call__(self, n: int) -> float:
        points = sorted(self.seconds.items())
        if n <= points[0][0]:
            return points[0][1]
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if n <= n1:
                return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2:] if len(points) > 1 else (points[0], points[0])
        slope = (s1 - s0) / (n1 - n0) if n1 > n0 else 0.0
        return s1 + slope * (n - n1)

    def relative(self) -> dict[int, float]:
        """Each probe's cost in single-token forwards (what the docs tabulate)."""
        one = self(1)
        return {n: s / one for n, s in sorted(self.seconds.items())}


def measure_verify_costs(forward, widest: int, repeats: int = 3, clock=time.perf_counter) -> VerifyCosts:
    """Time `forward(n)` (one target forward over n tokens, synchronised) for n = 1, 2, 4, … up to `widest` or until
    a forward costs `STEEP` single-token forwards; the probes take turns, the fastest of `repeats` counts."""

    def timed(n: int) -> float:
        start = clock()
        forward(n)
        return clock() - start

    sizes = [1]
    while sizes[-1] < widest:
        sizes.append(min(2 * sizes[-1], widest))
    best: dict[int, float] = {}
    covers = float(widest)
    for n in sizes:  # a warm-up of each size, then the timed turns
        forward(n)
        best[n] = timed(n)
        if n > 1 and best[n] > STEEP * best[1]:
            sizes, covers = sizes[: sizes.index(n) + 1], math.inf
            break
    for _ in range(repeats - 1):
        for n in sizes:
            best[n] = min(best[n], timed(n))
    return VerifyCosts(best, covers)


@dataclass
class Acceptance:
    """How often the target's next token was the drafter's k-th proposal, counted over the levels drafted rounds
    reached (a level of b children is a trial for ranks 1..b), on top of the `PRIOR_RANKS` pseudo-counts."""

    hits: list[float] = field(default_factory=lambda: [p * PRIOR_WEIGHT for p in PRIOR_RANKS])
    trials: list[float] = field(default_factory=lambda: [PRIOR_WEIGHT] * len(PRIOR_RANKS))

    def rank(self, k: int) -> float:
        """p_k (ranks past the counted ones: the last one's share, halved per rank)."""
        if k <= len(self.hits):
            return self.hits[k - 1] / self.trials[k - 1]
        return self.rank(len(self.hits)) * 0.5 ** (k - len(self.hits))

    def any_of(self, b: int) -> float:
        """q(b): the chance that one of b children is the target's token."""
        return min(sum(self.rank(k) for k in range(1, b + 1)), 1.0)

    def expected_tokens(self, shape: TreeConfig) -> float:
        """E[τ] of one round of `shape` (the bonus token included)."""
        tokens, reach = 1.0, 1.0
        for b in shape.branching:
            reach *= self.any_of(b)
            tokens += reach
        return tokens

    def observe(self, tree: Tree, paths: list[list[int]]) -> None:
        """Count one verified tree per row: at each level its path reached, the rank of the accepted child (its
        place among its siblings, drafted best first) or a miss of all of them."""
        for path in paths:
            node = 0
            for child in [*path, None]:
                siblings = tree.children[node]
                if not siblings:
                    break
                for k in range(min(len(siblings), len(self.hits))):
                    self.trials[k] += 1
                if child is None:
                    break
                rank = siblings.index(child)
                if rank < len(self.hits):
                    self.hits[rank] += 1
                node = child


def predicted_speedup(shape: TreeConfig, costs: VerifyCosts, acceptance: Acceptance, draft_level: float,
                      rows: int = 1) -> float:
    """S(a) above: the shape's tokens per second over plain decoding's, for `rows` rows decoded together."""
    return acceptance.expected_tokens(shape) * costs(rows) / (costs(rows * (shape.num_nodes + 1))
                                                              + shape.depth * draft_level)


def plan_arms(candidates: tuple[TreeConfig, ...], costs: VerifyCosts, acceptance: Acceptance, draft_level: float,
              rows: int = 1, allowed=None) -> list[int]:
    """Indices into `candidates` (those `allowed`, None: all): `none` (when it is one) and the `PLANNED_ARMS`
    drafting shapes of highest S, best first, those predicted at least `PLAN_FLOOR` of plain decoding's speed."""
    allowed = range(len(candidates)) if allowed is None else allowed
    speed = {i: predicted_speedup(candidates[i], costs, acceptance, draft_level, rows) for i in allowed
             if candidates[i].depth}
    scored = sorted((i for i in speed if speed[i] >= PLAN_FLOOR), key=lambda i: -speed[i])
    none = [i for i in allowed if not candidates[i].depth]
    return (none + scored[:PLANNED_ARMS]) or [max(speed, key=speed.get)]  # candidates without `none`: the best shape


def probe_forward(target_cache, token: torch.Tensor):
    """`forward(n)` for `measure_verify_costs`: a chain of n copies of `token` verified in `target_cache` (one row),
    the root committed alone, so the cache grows by one token per probe."""
    trees: dict[int, Tree] = {}

    def forward(n: int) -> None:
        tree = trees.setdefault(n, Tree(tuple(range(-1, n - 1))))
        scores, _ = target_cache.tree_forward(token.expand(1, n), tree)
        target_cache.commit([[]])
        if scores.device.type == "cuda":
            torch.cuda.synchronize(scores.device)
    return forward


REPLAN_ROUNDS = 16  # within a call, the arms are planned again after this many rounds
DRAFT_SAMPLES = 64  # drafted rounds the draft cost is the median of


class PlannedBandit(UCBBandit):
    """`auto` (the module docstring): the verify costs come from the engine at `start_call`. persistent: keep what
    was learnt across calls (a `SpeculativeDecoder` does). Rounds of a different batch size start the arms' statistics
    afresh (a round's tokens per second depend on its rows), the acceptance and costs are kept."""

    def __init__(self, persistent: bool = False) -> None:
        super().__init__(arms=CANDIDATES, reward="time", persistent=persistent)
        self.costs: VerifyCosts | None = None
        self.rows = 0

    def reset(self) -> None:
        super().reset()
        self.acceptance = Acceptance()
        self.lookup = Acceptance(hits=[PRIOR_LOOKUP * PRIOR_WEIGHT], trials=[PRIOR_WEIGHT])  # a chain: rank 1 only
        self.best = 1.0  # the planned arms' best S (`none`: 1)
        self.draft_levels: deque[float] = deque(maxlen=DRAFT_SAMPLES)  # seconds per level of recent drafted rounds

    def start_call(self, rows: int = 1, costs=None, fits: tuple[int, ...] | None = None) -> None:
        """costs: a callable measuring `VerifyCosts` up to a number of tokens (called when the ones kept do not
        cover this call's widest forward); fits: the candidates this call may plan (None: all)."""
        if self.persistent and rows != self.rows:
            learnt = self.acceptance, self.lookup, self.draft_levels
            self.reset()
            self.acceptance, self.lookup, self.draft_levels = learnt
        super().start_call(rows, costs, fits)
        self.rows = rows
        widest = rows * (max(self.arms[k].num_nodes for k in self.fits) + 1)
        if self.costs is None or self.costs.covers < widest:
            if costs is None:
                raise ValueError("auto plans its arms from the target's verify costs: start_call needs `costs`")
            self.costs = costs(widest)
        self.plan()

    @property
    def draft_level(self) -> float:
        """Seconds of one drafter level (resync included): the median over recent drafted rounds (a first round
        that pays a one-time setup does not count for many); before any, a prior share of a target token."""
        if self.draft_levels:
            return statistics.median(self.draft_levels)
        return PRIOR_DRAFT_LEVEL * self.costs(self.rows)

    def plan(self) -> None:
        self.active = tuple(plan_arms(self.arms, self.costs, self.acceptance, self.draft_level, self.rows,
                                      allowed=self.fits))
        self.best = max(predicted_speedup(self.arms[k], self.costs, self.acceptance, self.draft_level, self.rows)
                        for k in self.active)

    def lookup_length(self, offered: int) -> int:
        """How many of `offered` prompt-lookup tokens a round verifies: the chain length of highest S (no drafter
        cost; the acceptance counted over lookup rounds), 0 (no lookup round) when that S is below the best arm's."""
        scores = [predicted_speedup(TreeConfig((1,) * k), self.costs, self.lookup, 0.0, self.rows)
                  for k in range(1, offered + 1)]
        best = max(range(offered), key=scores.__getitem__, default=-1)
        return best + 1 if best >= 0 and scores[best] >= self.best else 0

    def select(self) -> int:
        if self.rounds and self.rounds % REPLAN_ROUNDS == 0:
            self.plan()
        return super().select()

    def observe(self, arm: int, tree: Tree, paths: list[list[int]]) -> None:
        (self.lookup if arm == self.lookup_arm else self.acceptance).observe(tree, paths)

    def update(self, arm: int, n_accept: int, draft_time: float | None = None,
               verify_time: float | None = None) -> float:
        if arm != self.lookup_arm and self.arms[arm].depth and draft_time is not None:
            self.draft_levels.append(draft_time / self.arms[arm].depth)
        return super().update(arm, n_accept, draft_time, verify_time)
