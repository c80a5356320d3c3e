"""Tree-shape policies: UCB over a set of `TreeConfig` arms (paper Eq. 1-2) and a fixed single shape."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tree_search.tree import TreeConfig

DEFAULT_ARMS = (TreeConfig((3, 3, 2, 1)), TreeConfig((3, 2, 2, 1, 1)), TreeConfig((2, 2, 2, 1, 1, 1)))


def tree_reward(n_accept: int, gamma: int, lambda_gamma: float) -> float:
    """r = −(1/N_accept + λ_γ·γ/N_accept): minus the inverse speedup of one round (paper Eq. 2 / A.4).

    N_accept counts the tokens the round committed (accepted draft tokens + the bonus/correction token, ≥ 1).
    """
    if n_accept < 1:
        raise ValueError(f"n_accept must be >= 1 (a round always commits the bonus token), got {n_accept}")
    return -(1.0 + lambda_gamma * gamma) / n_accept


def time_reward(n_accept: int, round_time: float, time_scale: float) -> float:
    """r = −(T_round / N_accept) / T_scale: minus the measured time per committed token, in units of T_scale.

    Unlike Eq. 2 this charges what a round really cost, including verifying a wider tree (nearly free on a GPU,
    not on a CPU), so the bandit can discover that a long chain beats a wide tree on a given machine.
    """
    if n_accept < 1:
        raise ValueError(f"n_accept must be >= 1 (a round always commits the bonus token), got {n_accept}")
    if round_time < 0 or time_scale <= 0:
        raise ValueError(f"round_time must be >= 0 and time_scale > 0, got {round_time}, {time_scale}")
    return -(round_time / n_accept) / time_scale


@dataclass
class ArmStats:
    pulls: int = 0
    reward_sum: float = 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.pulls if self.pulls else float("nan")


@dataclass
class UCBBandit:
    """UCB1 over tree configurations: pull every arm once, then argmax r̂_k + λ_UCB·sqrt(2 ln t / n_k).

    lambda_gamma: the draft/target per-step cost ratio in the reward; a float, or "auto" to estimate it
    online as the running ratio of measured drafter time per level to target verify time.
    persistent: keep the statistics across `generate` calls instead of resetting at the start of each.
    reward: "paper" (Eq. 2, `tree_reward`) or "time" (`time_reward`: measured draft + verify time per committed
    token, scaled by the running mean round time so it stays comparable with the exploration bonus).
    """

    arms: tuple[TreeConfig, ...] = DEFAULT_ARMS
    lambda_ucb: float = 0.1
    lambda_gamma: float | str = 0.1
    persistent: bool = False
    reward: str = "paper"
    stats: list[ArmStats] = field(init=False)
    rounds: int = field(init=False, default=0)
    _cost_ratio_sum: float = field(init=False, default=0.0)
    _cost_ratio_n: int = field(init=False, default=0)
    _time_sum: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.arms = tuple(TreeConfig.parse(a) for a in self.arms)
        if not self.arms:
            raise ValueError("UCBBandit needs at least one arm")
        if self.reward not in ("paper", "time"):
            raise ValueError(f"reward must be 'paper' or 'time', got {self.reward!r}")
        if self.lambda_ucb < 0:
            raise ValueError(f"lambda_ucb must be >= 0, got {self.lambda_ucb}")
        if isinstance(self.lambda_gamma, str):
            if self.lambda_gamma != "auto":
                raise ValueError(f"lambda_gamma must be a number >= 0 or 'auto', got {self.lambda_gamma!r}")
        elif self.lambda_gamma < 0:
            raise ValueError(f"lambda_gamma must be >= 0, got {self.lambda_gamma}")
        self.reset()

    def reset(self) -> None:
        """Forget all pulls and rewards (and the online cost-ratio estimate)."""
        self.stats = [ArmStats() for _ in self.arms]
        self.rounds = 0
        self._cost_ratio_sum, self._cost_ratio_n = 0.0, 0
        self._time_sum = 0.0

    def start_call(self) -> None:
        """Called by `generate` at the start of every call: resets unless persistent."""
        if not self.persistent:
            self.reset()

    @property
    def current_lambda_gamma(self) -> float:
        if self.lambda_gamma != "auto":
            return float(self.lambda_gamma)
        return self._cost_ratio_sum / self._cost_ratio_n if self._cost_ratio_n else 0.0

    def select(self) -> int:
        """Index of the arm to pull this round."""
        for k, s in enumerate(self.stats):
            if s.pulls == 0:
                return k
        t = self.rounds + 1
        scores = [s.mean_reward + self.lambda_ucb * math.sqrt(2.0 * math.log(t) / s.pulls) for s in self.stats]
        return max(range(len(scores)), key=scores.__getitem__)

    def update(self, arm: int, n_accept: int, draft_time: float | None = None, verify_time: float | None = None) -> float:
        """Record one round of `arm` that committed `n_accept` tokens; returns the reward."""
        gamma = self.arms[arm].depth
        if self.lambda_gamma == "auto" and draft_time is not None and verify_time and verify_time > 0:
            self._cost_ratio_sum += (draft_time / gamma) / verify_time
            self._cost_ratio_n += 1
        if self.reward == "time":
            if draft_time is None or verify_time is None:
                raise ValueError("reward='time' needs the round's draft_time and verify_time")
            round_time = draft_time + verify_time
            self._time_sum += round_time
            scale = self._time_sum / (self.rounds + 1)
            reward = time_reward(n_accept, round_time, scale) if scale > 0 else -1.0 / n_accept
        else:
            reward = tree_reward(n_accept, gamma, self.current_lambda_gamma)
        self.stats[arm].pulls += 1
        self.stats[arm].reward_sum += reward
        self.rounds += 1
        return reward

    def summary(self) -> dict[str, dict[str, float]]:
        """Per-arm pulls and mean reward, keyed by the arm's shape string."""
        return {str(a): {"pulls": s.pulls, "mean_reward": s.mean_reward} for a, s in zip(self.arms, self.stats)}


class FixedPolicy(UCBBandit):
    """Always the same tree; keeps the same statistics so reports look alike."""

    def __init__(self, tree: TreeConfig | str | tuple[int, ...], lambda_gamma: float = 0.1) -> None:
        super().__init__(arms=(TreeConfig.parse(tree),), lambda_ucb=0.0, lambda_gamma=lambda_gamma)

    def select(self) -> int:
        return 0
