"""UCB over tree shapes: the reward of paper Eq. 2, convergence on synthetic arms, reset/persistence, λ_γ."""
import math
import random

import pytest

from mamba_draft.tree import TreeConfig
from tree_search.arms import CANDIDATES, PlannedBandit
from tree_search.bandit import DEFAULT_ARMS, UCBBandit, time_reward, tree_reward
from tree_search.plan import LOOKUP_TOKENS, default_lookup_tokens
from tree_search.policy import FixedShape, TreePolicy, parse_policy, spec_of


def test_reward_formula():
    assert tree_reward(4, 5, 0.1) == pytest.approx(-(1 / 4 + 0.1 * 5 / 4))
    assert tree_reward(1, 3, 0.0) == -1.0
    assert tree_reward(6, 6, 0.5) == pytest.approx(-(1 + 3) / 6)
    # more accepted tokens is always better; a longer draft costs more at equal acceptance
    assert tree_reward(5, 4, 0.2) > tree_reward(3, 4, 0.2)
    assert tree_reward(3, 2, 0.2) > tree_reward(3, 5, 0.2)
    with pytest.raises(ValueError, match="n_accept"):
        tree_reward(0, 3, 0.1)


def _binomial_mean_reward(gamma: int, p: float, lam: float) -> float:
    """Exact E[r] when N_accept = 1 + Binomial(γ, p)."""
    return sum(math.comb(gamma, k) * p**k * (1 - p) ** (gamma - k) * tree_reward(1 + k, gamma, lam)
               for k in range(gamma + 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ucb_concentrates_on_the_best_arm(seed):
    rng = random.Random(seed)
    accept_prob = [0.35, 0.8, 0.5]  # per-level acceptance of each default arm: arm 1 is best by construction
    bandit = UCBBandit(arms=DEFAULT_ARMS, lambda_gamma=0.1)
    means = [_binomial_mean_reward(a.depth, p, 0.1) for a, p in zip(bandit.arms, accept_prob)]
    best = max(range(3), key=means.__getitem__)
    assert best == 1
    pulls = []
    for _ in range(500):
        arm = bandit.select()
        n_accept = 1 + sum(rng.random() < accept_prob[arm] for _ in range(bandit.arms[arm].depth))
        bandit.update(arm, n_accept)
        pulls.append(arm)
    assert pulls[:3] == [0, 1, 2]  # one pull of each arm first
    assert pulls.count(best) / len(pulls) >= 0.9
    assert bandit.stats[best].pulls == pulls.count(best)
    assert bandit.stats[best].mean_reward == pytest.approx(means[best], abs=0.05)


def test_ucb_explores_an_arm_whose_estimate_is_stale():
    bandit = UCBBandit(arms=("1", "2", "3"), lambda_ucb=1.0, lambda_gamma=0.0)
    for arm, n in [(0, 2), (1, 1), (2, 1)]:
        bandit.update(arm, n)
    assert bandit.select() == 0
    for _ in range(50):
        bandit.update(0, 2)
    # arm 0 is still best on average, but the bonus of the rarely pulled arms has grown past the gap
    assert bandit.select() in (1, 2)


def test_reset_per_call_and_persistence():
    fresh = UCBBandit(arms=("1,1", "2"))
    fresh.update(0, 2)
    fresh.start_call()
    assert fresh.rounds == 0 and all(s.pulls == 0 for s in fresh.stats)
    kept = UCBBandit(arms=("1,1", "2"), persistent=True)
    kept.update(0, 2)
    kept.start_call()
    assert kept.rounds == 1 and kept.stats[0].pulls == 1
    kept.reset()
    assert kept.rounds == 0


def test_auto_lambda_gamma_is_the_measured_cost_ratio():
    bandit = UCBBandit(arms=("1,1,1,1",), lambda_gamma="auto")
    assert bandit.current_lambda_gamma == 0.0
    bandit.update(0, 3, draft_time=0.004, verify_time=0.010)  # 1 ms per level / 10 ms -> 0.1
    bandit.update(0, 3, draft_time=0.012, verify_time=0.010)  # 3 ms per level -> 0.3
    assert bandit.current_lambda_gamma == pytest.approx(0.2)
    assert bandit.stats[0].reward_sum == pytest.approx(tree_reward(3, 4, 0.1) + tree_reward(3, 4, 0.2))


def test_fixed_shape_always_picks_its_tree():
    policy = FixedShape("3,2,2,1,1")
    assert policy.arms == (TreeConfig((3, 2, 2, 1, 1)),)
    for n in (1, 4, 2):
        assert policy.select() == 0
        policy.update(0, n)
    assert policy.summary()["(3,2,2,1,1)"] == {"pulls": 3, "mean_reward": pytest.approx(-0.875)}
    policy.start_call()
    assert policy.summary()["(3,2,2,1,1)"]["pulls"] == 0


def test_one_policy_grammar():
    """`tree_search.policy.parse_policy`: what generate, the CLI, the bench and regenerate all read."""
    assert isinstance(parse_policy("auto"), PlannedBandit) and spec_of(parse_policy(" AUTO ")) == "auto"
    assert parse_policy("none").arms == (TreeConfig(()),) and parse_policy(" 3,2,1 ").arms == (TreeConfig((3, 2, 1)),)
    assert parse_policy("chain:4").arms == (TreeConfig((1, 1, 1, 1)),)
    assert parse_policy((2, 1)).arms == (TreeConfig((2, 1)),)
    paper = parse_policy("bandit")
    assert paper.arms == DEFAULT_ARMS and paper.reward == "paper" and not paper.persistent
    timed = parse_policy("bandit-time:none/1,1/2,1", persistent=True)
    assert timed.arms == (TreeConfig(()), TreeConfig((1, 1)), TreeConfig((2, 1))) and timed.reward == "time"
    assert timed.persistent and parse_policy(timed) is timed
    for spec in ("bandit-time:none/1,1/2,1", "bandit:3,2,1", "2,1", "none"):
        assert spec_of(parse_policy(spec)) == spec
    assert isinstance(FixedShape("1"), TreePolicy) and isinstance(paper, TreePolicy)
    for bad in ("chain:0", "bandit:3;2", "tree", "3,,2", "bandit:"):
        with pytest.raises(ValueError, match="expected auto, none"):
            parse_policy(bad)
    with pytest.raises(TypeError, match="tree must be"):
        parse_policy(3.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(arms=()), "at least one arm"), (dict(lambda_ucb=-1), "lambda_ucb"), (dict(lambda_gamma=-0.1), "lambda_gamma"),
     (dict(lambda_gamma="fast"), "lambda_gamma"), (dict(arms=("3,0",)), "positive")],
)
def test_bad_bandit_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UCBBandit(**kwargs)


def test_time_reward_formula():
    assert time_reward(4, 2.0, 1.0) == pytest.approx(2.0)  # 4 tokens in 2 s: 2 tokens/s
    assert time_reward(2, 1.0, 0.5) == pytest.approx(4.0)  # in units of 0.5 tokens/s
    assert time_reward(4, 1.0, 1.0) > time_reward(4, 2.0, 1.0)  # same tokens in less time is better
    with pytest.raises(ValueError, match="n_accept"):
        time_reward(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="throughput_scale"):
        time_reward(1, 1.0, 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_time_reward_prefers_cheap_chain_that_eq2_ranks_lower(seed):
    """A wide tree accepts a bit more per round but costs twice the time (CPU verification): Eq. 2 prefers the
    tree, the time reward the chain — which is the faster arm in tokens per second."""
    rng = random.Random(seed)
    arms = ("1,1,1,1", "3,2,2,1")
    accepts = {0: lambda: 1 + sum(rng.random() < 0.8 for _ in range(4)),  # mean 4.2 per round, 1.0 s
               1: lambda: 1 + sum(rng.random() < 0.95 for _ in range(4))}  # mean 4.8 per round, 2.0 s
    seconds = {0: 1.0, 1: 2.0}
    picks = {}
    for reward in ("paper", "time"):
        bandit = UCBBandit(arms=arms, lambda_gamma=0.1, reward=reward)
        pulls = []
        for _ in range(400):
            arm = bandit.select()
            bandit.update(arm, accepts[arm](), draft_time=0.1 * seconds[arm], verify_time=0.9 * seconds[arm])
            pulls.append(arm)
        picks[reward] = pulls.count(0) / len(pulls)
    assert picks["time"] >= 0.9  # the chain: 4.2 tokens/s vs 2.4
    assert picks["paper"] <= 0.1  # Eq. 2 sees only acceptance and depth
    with pytest.raises(ValueError, match="draft_time and verify_time"):
        UCBBandit(arms=arms, reward="time").update(0, 3)
    with pytest.raises(ValueError, match="reward must be"):
        UCBBandit(reward="speed")


@pytest.mark.parametrize("seed", [0, 1])
def test_time_reward_ranks_arms_by_throughput_not_mean_per_round_cost(seed):
    """An all-or-nothing chain (1 or 7 tokens, mean 4, per 1 s round) beats a steady tree (3 tokens per 1 s) in
    tokens per second, but its mean per-round cost E[T/N] = 0.57 s is worse than the tree's 0.33 s (Jensen):
    the arm's value must be linear in the tokens (throughput), or the bandit settles on the slower arm; and an
    unlucky 1-token first round must not shut the chain out."""
    rng = random.Random(seed)
    bandit = UCBBandit(arms=("1,1,1,1,1,1", "3,2,1"), reward="time")
    accepts = {0: lambda: 7 if rng.random() < 0.5 else 1, 1: lambda: 3}
    pulls = []
    for _ in range(400):
        arm = bandit.select()
        bandit.update(arm, accepts[arm](), draft_time=0.2, verify_time=0.8)
        pulls.append(arm)
    assert pulls.count(0) / len(pulls) >= 0.8
    chain, tree = bandit.values()
    assert chain > tree
    assert bandit.summary()["(3,2,1)"]["mean_reward"] == pytest.approx(tree)


def test_time_reward_exploration_shrinks_with_an_arms_spread():
    """A batch's round averages many rows, so a losing draft arm's rewards barely vary: it is dropped after a few
    pulls (UCB1's 1/sqrt(n) bonus kept pulling it: 11 of 200 rounds here), while an arm whose rewards do vary keeps
    its exploration and, being better on average, takes the rounds (UCB1: 167 of 200)."""
    steady = UCBBandit(arms=("none", "1,1"), reward="time")
    for _ in range(200):
        arm = steady.select()
        steady.update(arm, 8, draft_time=0.001, verify_time=1.0 if arm == 0 else 1.6)  # 8 rows, 1 token each
    assert steady.stats[1].pulls <= 6
    rng = random.Random(0)
    noisy = UCBBandit(arms=("none", "1,1"), reward="time")
    for _ in range(200):
        arm = noisy.select()
        noisy.update(arm, 1 if arm == 0 else rng.choice([1, 3]), draft_time=0.001, verify_time=1.0 if arm == 0 else 1.6)
    assert noisy.stats[1].pulls >= 180  # 2 tokens per 1.6 s on average beats 1 per 1 s


def test_auto_plans_among_the_candidates_and_lookup_follows_the_device():
    """tree="auto": the measured-time bandit over the candidate shapes (`none` among them) on every device, whose
    arms the cost curve picks (tests/test_arms.py); prompt-lookup rounds for one prompt on a CPU."""
    auto = parse_policy("auto")
    assert auto.arms == CANDIDATES and auto.reward == "time" and TreeConfig(()) in auto.arms
    assert parse_policy("bandit").arms == DEFAULT_ARMS  # asked for by name: the paper's, on any device
    assert default_lookup_tokens("auto", "cpu", False, False) == LOOKUP_TOKENS
    assert [default_lookup_tokens(*case) for case in (("auto", "cpu", True, False), ("auto", "cpu", False, True),
                                                      ("auto", "cuda", False, False), ("1,1", "cpu", False, False))] \
        == [0, 0, 0, 0]
