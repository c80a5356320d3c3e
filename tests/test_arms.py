"""Arms from the cost curve (tree_search/arms.py): verify costs, acceptance by rank, the plan, and `auto` in the
engine learning across a SpeculativeDecoder's calls."""
import math
import statistics

import pytest
import torch

from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import aligned_drafter, hf_greedy, tiny_llama
from tests.helpers.tree_models import prompts as make_prompts
from tree_search import SpeculativeDecoder
from tree_search.arms import (
    CANDIDATES, PRIOR_RANKS, Acceptance, PlannedBandit, VerifyCosts, measure_verify_costs, plan_arms,
    predicted_speedup,
)
from tree_search.bandit import UCBBandit

STEEP_CPU = VerifyCosts({1: 19.3, 2: 21.8, 4: 29.3, 8: 54.4}, math.inf)  # the AVX2 kind's SmolLM2 step (ms)
FLAT = VerifyCosts({1: 20.0, 2: 20.2, 4: 20.5, 8: 21.0, 16: 23.0, 32: 27.0, 64: 36.0}, math.inf)


def test_verify_costs_interpolate_and_extend_along_the_last_slope():
    assert STEEP_CPU(1) == 19.3 and STEEP_CPU(3) == pytest.approx((21.8 + 29.3) / 2)
    assert STEEP_CPU(16) == pytest.approx(54.4 + 8 * (54.4 - 29.3) / 4)  # linear past the last probe
    assert STEEP_CPU.relative()[8] == pytest.approx(54.4 / 19.3)


def test_the_probe_stops_where_forwards_turn_steep():
    now, calls = [0.0], []

    def forward(n, per_token=0.001, fixed=0.001):  # on a clock of its own: 1 ms + 1 ms a token
        calls.append(n)
        now[0] += fixed + per_token * n + (0.01 if len(calls) == 1 else 0.0)  # the first call pays a warm-up

    costs = measure_verify_costs(forward, widest=64, repeats=2, clock=lambda: now[0])
    # 8 tokens cost 4.5x one, past STEEP (3x): no wider probe, the rest extrapolated linearly
    assert costs.seconds == pytest.approx({1: 0.002, 2: 0.003, 4: 0.005, 8: 0.009})
    assert set(calls) == {1, 2, 4, 8} and costs.covers == math.inf and costs(16) == pytest.approx(0.017)
    flat = measure_verify_costs(lambda n: forward(n, per_token=1e-5, fixed=0.002), widest=5, repeats=1,
                                clock=lambda: now[0])
    assert sorted(flat.seconds) == [1, 2, 4, 5] and flat.covers == 5  # flat up to what was asked: no further


def test_acceptance_counts_ranks_along_each_accepted_path():
    tree = TreeConfig((2, 1)).build()  # root -> nodes 1, 2 (drafted best first) -> 3 under 1, 4 under 2
    acc = Acceptance(hits=[0.0] * 4, trials=[0.0] * 4)
    acc.observe(tree, [[2, 4], [1], []])
    # row 0: rank 2 at level 1 (a trial for ranks 1-2), rank 1 at level 2 (a trial for rank 1), then a leaf
    # row 1: rank 1 at level 1, then a miss of the one child at level 2; row 2: a miss of both at level 1
    assert acc.hits == [2.0, 1.0, 0.0, 0.0] and acc.trials == [5.0, 3.0, 0.0, 0.0]
    prior = Acceptance()
    assert prior.rank(1) == PRIOR_RANKS[0] and prior.rank(6) == pytest.approx(PRIOR_RANKS[-1] / 4)
    q1, q2 = prior.any_of(1), prior.any_of(2)
    assert prior.expected_tokens(TreeConfig((2, 1))) == pytest.approx(1 + q2 + q2 * q1)
    assert prior.expected_tokens(TreeConfig(())) == 1.0


def test_flat_verification_plans_deeper_and_wider_trees_than_steep():
    """The rule's point: the same drafter, two machines. Where verifying n tokens costs about one, the plan keeps
    trees of many nodes; where it grows with n, short chains; where drafts are rarely accepted, nothing pays."""
    good = Acceptance(hits=[6.0, 1.0, 0.4, 0.2], trials=[8.0] * 4)
    steep = [CANDIDATES[i] for i in plan_arms(CANDIDATES, STEEP_CPU, good, draft_level=2.0)]
    flat = [CANDIDATES[i] for i in plan_arms(CANDIDATES, FLAT, good, draft_level=2.0)]
    assert steep[0] == flat[0] == TreeConfig(()) and len(steep) == len(flat) == 4
    assert min(a.num_nodes for a in flat[1:]) > max(a.num_nodes for a in steep[1:])
    assert max(a.depth for a in flat[1:]) > max(a.depth for a in steep[1:])
    poor = Acceptance(hits=[0.8, 0.2, 0.1, 0.0], trials=[8.0] * 4)
    assert all(predicted_speedup(a, STEEP_CPU, poor, 2.0) < 1 for a in CANDIDATES if a.depth)
    # a batch of 8 on the steep CPU: every shape far below plain decoding, so none is pulled at all (the prior)
    assert [CANDIDATES[i] for i in plan_arms(CANDIDATES, STEEP_CPU, Acceptance(), 2.0, rows=8)] == [TreeConfig(())]
    assert len(plan_arms(CANDIDATES, FLAT, Acceptance(), 2.0, rows=8)) == 4  # flat: trees still pay
    # a slow drafter shortens the trees it drafts
    slow = [CANDIDATES[i] for i in plan_arms(CANDIDATES, FLAT, good, draft_level=15.0)]
    assert max(a.depth for a in slow[1:]) < max(a.depth for a in flat[1:])


def test_planned_bandit_learns_across_calls_when_persistent():
    measured = []

    def costs(widest):
        measured.append(widest)
        return FLAT

    bandit = PlannedBandit(persistent=True)
    with pytest.raises(ValueError, match="verify costs"):
        bandit.start_call(1)
    bandit.start_call(1, costs)
    assert measured == [max(a.num_nodes for a in CANDIDATES) + 1] and bandit.active[0] == 0 and len(bandit.active) == 4
    pulled = []
    for _ in bandit.active:  # every planned arm once first
        pulled.append(bandit.select())
        bandit.update(pulled[-1], 2, draft_time=0.001, verify_time=0.02)
    assert sorted(pulled) == sorted(bandit.active)
    deep = TreeConfig((3, 3, 2, 1))
    bandit.observe(CANDIDATES.index(deep), deep.build(), [[]] * 50)  # the drafter's three best keep missing
    assert bandit.draft_level == pytest.approx(statistics.median(0.001 / CANDIDATES[a].depth for a in pulled[1:]))
    bandit.start_call(1, costs)  # replanned: nothing deep is worth drafting when nothing is accepted
    assert measured == [max(a.num_nodes for a in CANDIDATES) + 1]  # measured once
    assert sum(s.pulls for s in bandit.stats) == 4 and bandit.acceptance.rank(1) < 0.1
    assert max(CANDIDATES[k].depth for k in bandit.active) <= 2
    bandit.start_call(3, costs)  # another batch size: the arms' statistics start afresh, what was learnt stays
    assert sum(s.pulls for s in bandit.stats) == 0 and bandit.acceptance.rank(1) < 0.1
    fresh = PlannedBandit()
    fresh.costs = FLAT
    fresh.start_call(1)  # not persistent: forgets the acceptance, keeps the costs it was given
    assert fresh.acceptance.rank(1) == PRIOR_RANKS[0]


def test_a_decoder_probes_verify_costs_once_and_learns_the_acceptance(tmp_path):
    """`auto` in a SpeculativeDecoder: the target's verify costs probed once (kept by the decoder), the acceptance
    learnt over calls, outputs the target's own."""
    target = tiny_llama()
    drafter, prompts = aligned_drafter(tmp_path, target), make_prompts(64, 2, seed=5)
    decoder = SpeculativeDecoder(target, drafter, lookup_tokens=0)  # every round an arm's
    policy = decoder.policy
    first = decoder.generate(prompts[0], max_new_tokens=24)
    assert torch.equal(first.tokens, hf_greedy(target, prompts[0], 24))
    costs = dict(decoder.costs)
    assert len(costs) == 1 and policy.costs is next(iter(costs.values())) and policy.costs.seconds[1] > 0
    assert sum(policy.acceptance.trials) > sum(Acceptance().trials)  # every planned arm was pulled
    pulls = sum(s.pulls for s in policy.stats)
    second = decoder.generate(prompts[1], max_new_tokens=24)
    assert torch.equal(second.tokens, hf_greedy(target, prompts[1], 24))
    assert decoder.costs == costs and decoder.policy is policy
    assert sum(s.pulls for s in policy.stats) == pulls + len(second.stats.accepted_lengths)  # learnt on
    other = SpeculativeDecoder(target, drafter)
    other.generate(prompts[0], max_new_tokens=4)
    assert other.policy.costs is not policy.costs and other.costs  # another decoder probes for itself


def test_lookup_rounds_verify_as_many_tokens_as_pay():
    """A prompt-lookup round verifies the chain length of highest S under the lookups' own acceptance, or is skipped
    (0) when that S is below the best planned arm's; UCB and fixed policies take every token offered."""
    chain = TreeConfig((1,) * 8).build()
    steep = PlannedBandit()
    steep.costs = STEEP_CPU
    steep.start_call(1)
    assert 1 <= steep.lookup_length(8) < 8  # at the prior's acceptance a few tokens, not all eight
    steep.observe(steep.lookup_arm, chain, [[]] * 100)  # lookups keep missing
    assert steep.lookup_length(8) == 0 and steep.acceptance.rank(1) == PRIOR_RANKS[0]  # the drafter's untouched
    flat = PlannedBandit()
    flat.costs = FLAT
    flat.start_call(1)
    flat.observe(flat.lookup_arm, chain, [list(range(1, 9))] * 100)  # every lookup token accepted
    assert flat.lookup_length(8) == 8 and flat.lookup_length(3) == 3
    assert UCBBandit().lookup_length(8) == 8


def test_the_lookup_arm_is_charged_and_reported_beside_the_shapes_without_steering_them():
    """A lookup round is a pull of the policy's lookup arm (after the shapes): counted and reported as "lookup", while
    the shapes' UCB values, round count and the time reward's scale stay what the shapes' own rounds made them."""
    bandit = UCBBandit(arms=("none", "1,1"), reward="time")
    assert bandit.lookup_arm == 2
    bandit.update(0, 1, draft_time=0.0, verify_time=0.01)
    bandit.update(1, 2, draft_time=0.002, verify_time=0.012)
    before = bandit.values()[:2], bandit.rounds, bandit._seconds
    bandit.update(bandit.lookup_arm, 6, draft_time=0.0, verify_time=0.013)
    assert (bandit.values()[:2], bandit.rounds, bandit._seconds) == before
    summary = bandit.summary()
    assert summary["lookup"]["pulls"] == 1 and summary["none"]["pulls"] == summary["(1,1)"]["pulls"] == 1
    assert bandit.select() in (0, 1)  # the lookup arm is pulled when a lookup is offered, never by UCB
