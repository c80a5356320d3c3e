"""UCB over a set of `TreeConfig` arms (paper Eq. 1-2): the tree policy that learns which shape pays.

An arm may be `none` (`TreeConfig(())`, no speculation: a plain decoding step, γ = 0, so its Eq. 2 reward is -1 and
its time reward the target's own throughput), the fallback when drafting costs more than it saves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from mamba_draft.tree import TreeConfig

DEFAULT_ARMS = (TreeConfig((3, 3, 2, 1)), TreeConfig((3, 2, 2, 1, 1)), TreeConfig((2, 2, 2, 1, 1, 1)))


def tree_reward(n_accept: int, gamma: int, lambda_gamma: float) -> float:
    """r = −(1/N_accept + λ_γ·γ/N_accept): minus the inverse speedup of one round (paper Eq. 2 / A.4); N_accept
    counts the tokens the round committed (bonus/correction token included, ≥ 1)."""
    if n_accept < 1:
        raise ValueError(f"n_accept must be >= 1 (a round always commits the bonus token), got {n_accept}")
    return -(1.0 + lambda_gamma * gamma) / n_accept


def time_reward(n_accept: int, round_time: float, throughput_scale: float) -> float:
    """r = (N_accept / T_round) / S: the round's measured tokens per second, in units of S. Unlike Eq. 2 it charges
    what a round really cost. Throughput rather than time per token: a mean of T/N would favour steady arms
    (E[1/N] > 1/E[N]) and one unlucky 1-token round could shut an arm out."""
    if n_accept < 1:
        raise ValueError(f"n_accept must be >= 1 (a round always commits the bonus token), got {n_accept}")
    if round_time <= 0 or throughput_scale <= 0:
        raise ValueError(f"round_time and throughput_scale must be > 0, got {round_time}, {throughput_scale}")
    return (n_accept / round_time) / throughput_scale


@dataclass
class ArmStats:
    pulls: int = 0
    reward_sum: float = 0.0  # Eq. 2 rewards, or (time reward) per-round tokens per second
    square_sum: float = 0.0  # of the same rewards (the time reward's exploration scales with their spread)

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.pulls if self.pulls else float("nan")


@dataclass
class UCBBandit:
    """UCB1 over tree configurations: pull every arm once, then argmax r̂_k + λ_UCB·sqrt(2 ln t / n_k).

    lambda_gamma: the draft/target per-step cost ratio in the reward, or "auto": the running ratio of measured drafter
    time per level to target verify time. persistent: keep the statistics across `generate` calls. reward: "paper"
    (Eq. 2, `tree_reward`) or "time" (`time_reward`, in units of the throughput of all rounds so far, on the scale of
    the exploration bonus). lambda_ucb: None = 0.1 (the paper's) for the paper reward and 0.5 for the time reward,
    whose values spread wider: below ~0.4 one unlucky first round shuts a good chain out (tests/test_bandit.py).
    """

    arms: tuple[TreeConfig, ...] = DEFAULT_ARMS
    lambda_ucb: float | None = None
    lambda_gamma: float | str = 0.1
    persistent: bool = False
    reward: str = "paper"
    stats: list[ArmStats] = field(init=False)  # these two and the running totals: set by `reset`
    rounds: int = field(init=False)

    def __post_init__(self) -> None:
        self.arms = tuple(TreeConfig.parse(a) for a in self.arms)
        if not self.arms:
            raise ValueError("UCBBandit needs at least one arm")
        if self.reward not in ("paper", "time"):
            raise ValueError(f"reward must be 'paper' or 'time', got {self.reward!r}")
        if self.lambda_ucb is None:
            self.lambda_ucb = 0.5 if self.reward == "time" else 0.1
        if self.lambda_ucb < 0:
            raise ValueError(f"lambda_ucb must be >= 0, got {self.lambda_ucb}")
        if self.lambda_gamma != "auto" and (isinstance(self.lambda_gamma, str) or self.lambda_gamma < 0):
            raise ValueError(f"lambda_gamma must be a number >= 0 or 'auto', got {self.lambda_gamma!r}")
        self.reset()

    @property
    def lookup_arm(self) -> int:
        """The arm a prompt-lookup round is pulled, observed and charged as: after the shapes. `lookup_length` decides
        when it is pulled (a lookup is offered by the context, not chosen among the shapes), and its rounds neither
        count toward the shapes' UCB nor set the time reward's scale."""
        return len(self.arms)

    def reset(self) -> None:
        """Forget all pulls and rewards (and the online cost-ratio and throughput estimates)."""
        self.stats = [ArmStats() for _ in self.arms]
        self.lookup_stats = ArmStats()  # the lookup arm's
        self.fits = tuple(range(len(self.arms)))  # the arms this call's target cache holds (`start_call`)
        self.active = self.fits  # the arms `select` may pull (`arms.PlannedBandit` plans them)
        self.rounds = 0
        self._cost_ratio_sum, self._cost_ratio_n = 0.0, 0
        self._seconds, self._tokens = 0.0, 0  # all rounds (the time reward's scale)

    def start_call(self, rows: int = 1, costs=None, fits: tuple[int, ...] | None = None) -> None:
        """Called by `generate` at the start of every call (`rows` prompts; `costs`: what `arms.PlannedBandit`
        plans from, unused here; `fits`: the arms this call may pull, None: all): resets unless persistent."""
        if not self.persistent:
            self.reset()
        self.fits = tuple(range(len(self.arms))) if fits is None else tuple(fits)
        self.active = self.fits

    def observe(self, arm: int, tree, paths: list[list[int]]) -> None:
        """The tree a round of `arm` verified (the lookup arm's: a prompt-lookup chain) and each row's accepted path
        (`arms.PlannedBandit` learns the acceptance from them)."""

    def lookup_length(self, offered: int) -> int:
        """How many of `offered` prompt-lookup tokens a round verifies (0: none; here all)."""
        return offered

    @property
    def current_lambda_gamma(self) -> float:
        if self.lambda_gamma != "auto":
            return float(self.lambda_gamma)
        return self._cost_ratio_sum / self._cost_ratio_n if self._cost_ratio_n else 0.0

    def select(self) -> int:
        """Index of the arm to pull this round (among the active ones)."""
        for k in self.active:
            if self.stats[k].pulls == 0:
                return k
        t, values = self.rounds + 1, self.values()
        return max(self.active, key=lambda k: values[k] + self.lambda_ucb * math.sqrt(2.0 * math.log(t))
                   * self.spread(k))

    def spread(self, arm: int) -> float:
        """The exploration bonus's per-arm factor: 1/sqrt(n) (UCB1) for the paper reward; for the time reward
        sqrt(1 + M2) / n, M2 the sum of squared deviations of the arm's rewards (in units of the overall throughput):
        UCB1's after one pull, then shrinking with the spread the arm has shown (≈ σ/sqrt(n))."""
        s = self.stats[arm]
        if self.reward == "paper":
            return 1.0 / math.sqrt(s.pulls)
        scale = self._tokens / self._seconds
        m2 = max(s.square_sum - s.reward_sum ** 2 / s.pulls, 0.0) / scale ** 2
        return math.sqrt(1.0 + m2) / s.pulls

    def values(self) -> list[float]:
        """Each shape's estimated reward (NaN before its first pull)."""
        return [self.value(s) for s in self.stats]

    def value(self, stats: ArmStats) -> float:
        """An arm's estimated reward from its statistics (the time reward in units of the shapes' throughput)."""
        if self.reward == "paper" or not self._seconds:
            return stats.mean_reward
        return stats.mean_reward / (self._tokens / self._seconds)

    def update(self, arm: int, n_accept: int, draft_time: float | None = None, verify_time: float | None = None) -> float:
        """Record one round of `arm` that committed `n_accept` tokens; returns the arm's updated value. A lookup arm's
        round updates its own statistics only (`lookup_arm`)."""
        lookup = arm == self.lookup_arm
        gamma = 0 if lookup else self.arms[arm].depth
        stats = self.lookup_stats if lookup else self.stats[arm]
        # the cost ratio is drafter time per level: a "none" or lookup round (γ = 0) drafts nothing to measure it by
        if self.lambda_gamma == "auto" and gamma and draft_time is not None and verify_time and verify_time > 0:
            self._cost_ratio_sum += (draft_time / gamma) / verify_time
            self._cost_ratio_n += 1
        if self.reward == "time":
            if draft_time is None or verify_time is None:
                raise ValueError("reward='time' needs the round's draft_time and verify_time")
            reward = time_reward(n_accept, draft_time + verify_time, 1.0)
            stats.square_sum += reward * reward
        else:
            reward = tree_reward(n_accept, gamma, self.current_lambda_gamma)
        stats.reward_sum += reward
        stats.pulls += 1
        if not lookup:
            if self.reward == "time":
                self._seconds += draft_time + verify_time
                self._tokens += n_accept
            self.rounds += 1
        return self.value(stats)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per-arm pulls and value (mean reward), keyed by the arm's shape string ("lookup" for the lookup arm): the
        arms pulled or active."""
        names, stats = [*map(str, self.arms), "lookup"], [*self.stats, self.lookup_stats]
        return {names[k]: {"pulls": s.pulls, "mean_reward": self.value(s)}
                for k, s in enumerate(stats) if s.pulls or k in self.active}
