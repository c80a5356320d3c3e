"""Tree policies: what picks each round's tree shape, and the one grammar every command writes them in.

    auto                        the default (`arms.PlannedBandit`): the measured-time bandit over none and the
                                shapes this machine's verify costs and the drafter's acceptance favour (on a CPU
                                with prompt-lookup rounds, `plan.default_lookup_tokens`)
    none | 3,2,2,1,1 | chain:5  one fixed shape (`none`: no speculation, a plain decoding step per round;
                                chain:N is N ones)
    bandit[:A/B/...]            UCB over the arms A, B, ... (default: the paper's three), the paper's reward (Eq. 2)
    bandit-time[:A/B/...]       the same with the measured-time reward (tokens per second of each round)

A policy is any object with the `TreePolicy` surface: `UCBBandit` and `FixedShape` are the two here.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from mamba_draft.tree import TreeConfig
from tree_search.arms import PlannedBandit
from tree_search.bandit import DEFAULT_ARMS, UCBBandit

GRAMMAR = "auto, none, a shape like 3,2,2,1,1, chain:N, bandit[:A/B/...] or bandit-time[:A/B/...]"


@runtime_checkable
class TreePolicy(Protocol):
    """Picks one arm per round (a tree shape, or the lookup arm when a prompt lookup is offered and pays) and learns
    from what each round committed and cost."""

    arms: tuple[TreeConfig, ...]
    lookup_arm: int  # the arm prompt-lookup rounds are pulled as (len(arms): after the shapes)
    reward: str  # "time": rewarded with the round's tokens (its seconds given); "paper": tokens per row

    def start_call(self, rows: int = 1, costs=None) -> None: ...

    def select(self) -> int: ...

    def observe(self, arm: int, tree, paths: list[list[int]]) -> None: ...

    def lookup_length(self, offered: int) -> int:
        """How many of `offered` prompt-lookup tokens a round of the lookup arm verifies (0: no such round)."""

    def update(self, arm: int, n_accept: float, draft_time: float | None = None,
               verify_time: float | None = None) -> float: ...

    def summary(self) -> dict[str, dict[str, float]]: ...


class FixedShape(UCBBandit):
    """Always the same tree shape: a one-arm bandit, so its rounds are scored with the paper's reward (Eq. 2,
    λ_γ 0.1) and reports read like a bandit's."""

    def __init__(self, tree: TreeConfig | str | tuple[int, ...]) -> None:
        super().__init__(arms=(TreeConfig.parse(tree),))


def is_auto(spec) -> bool:
    """Whether a spec, or a policy object, is `auto` (`arms.PlannedBandit`)."""
    return isinstance(spec, PlannedBandit) or isinstance(spec, str) and spec.strip().lower() == "auto"


def parse_policy(spec, persistent: bool = False) -> TreePolicy:
    """A policy from the grammar above, or a TreeConfig / tuple shape; a policy object passes through unchanged.
    `persistent` keeps a bandit's statistics across generate calls."""
    if isinstance(spec, TreePolicy):
        return spec
    if isinstance(spec, (TreeConfig, tuple, list)):
        return FixedShape(spec)
    if not isinstance(spec, str):
        raise TypeError(f"tree must be a policy spec ({GRAMMAR}), a TreeConfig or a policy object; "
                        f"got {type(spec).__name__}")
    text = spec.strip().lower()
    if text == "auto":
        return PlannedBandit(persistent=persistent)
    kind, colon, arg = text.partition(":")
    try:
        if kind in ("bandit", "bandit-time"):
            if colon and not arg:
                raise ValueError("arms follow the colon, separated by '/'")
            arms = tuple(TreeConfig.parse(a) for a in arg.split("/")) if arg else DEFAULT_ARMS
            return UCBBandit(arms=arms, reward="time" if kind == "bandit-time" else "paper", persistent=persistent)
        if kind == "chain":
            if not arg.isdigit() or int(arg) < 1:
                raise ValueError(f"chain:N takes a positive length, got {arg!r}")
            return FixedShape(TreeConfig((1,) * int(arg)))
        return FixedShape(text)
    except ValueError as err:
        raise ValueError(f"tree policy {spec!r}: {err} (expected {GRAMMAR})") from None


def spec_of(policy: TreePolicy) -> str:
    """The grammar's text for a policy (what reports print): the inverse of `parse_policy`."""
    if isinstance(policy, FixedShape):
        return policy.arms[0].spec
    if isinstance(policy, PlannedBandit):
        return "auto"
    kind = "bandit-time" if policy.reward == "time" else "bandit"
    return f"{kind}:" + "/".join(a.spec for a in policy.arms)
