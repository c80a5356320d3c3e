"""Sampling is lossless: the first two generated tokens follow the target's own processed distribution.

Setup: vocab-8 Llama target and an unrelated vocab-8 Mamba drafter (both with sharpened heads so p and q differ
a lot and rejections/residuals are exercised), a one-token prompt, 2 new tokens, N = 10,000 seeded runs per case
(4,000 single calls for the prompt-lookup case), in batches of 100 rows (row b of a call seeded s draws what the single call seeded s + b draws). The bound is
tests/helpers/sampling_law.py's, over the K = 64 outcomes: ≈ 0.06 at N = 10,000, which a lossless sampler exceeds
with probability < 1e-6. Deliberately broken rules fail it by a wide margin (measured with this setup while writing
the test, N = 4,000 runs; a broken rule's bias does not shrink with N): sampling the correction from p instead of
the residual norm(max(p − q, 0)) gave TV 0.20 (chain), 0.25 (wide tree) and 0.19 (a prompt-lookup proposal); not
renormalising q after a rejected sibling (q_{i+1} = q_i) gave TV 0.13 on the wide tree.
"""
import pytest
import torch

from tests.helpers.sampling_law import assert_follows, empirical, exact_first_two, seeded_runs
from tests.helpers.tree_models import random_drafter, tiny_llama
from tree_search import UCBBandit
from tree_search.generate import generate, generate_autoregressive
from tree_search.sampling import SamplingParams

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)

VOCAB = 8
RUNS, BATCH = 10_000, 100  # bound ~0.06 at delta 1e-6; the deliberately broken rules measured 0.13-0.25
LOOKUP_RUNS = 2_500  # one call per run (lookup rounds take one prompt): bound ~0.12, the broken rule measured 0.19
PROMPT = [3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, head_scale=3.0)
    drafter = random_drafter(tmp_path_factory.mktemp("d"), vocab=VOCAB, hidden=16, layers=1, seed=12, head_scale=3.0)
    return target, drafter


CASES = {
    "chain": dict(tree="1,1", temperature=1.0),
    "wide-tree": dict(tree="4,2", temperature=0.9, top_k=6),
    "bandit": dict(tree=UCBBandit(arms=("1,1", "3,2", "2,1,1"), lambda_ucb=0.5, persistent=True), temperature=1.2,
                   top_p=0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_the_target_distribution(models, case):
    target, drafter = models
    kwargs = dict(CASES[case])
    params = SamplingParams(kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    rounds_with_rejection = []

    def run(seed, rows):
        # the rejection rule itself: seeded rows would otherwise draw keyed by position (test_batch_generate)
        result = generate(target, drafter, [PROMPT] * rows, max_new_tokens=2, verifier="sampling", seed=seed,
                          verifier_params={"keyed": False}, **kwargs)
        rounds_with_rejection.extend(row.stats.accepted_lengths[0] == 1 for row in result.rows)
        return result.new_tokens

    outcomes = seeded_runs(run, RUNS, BATCH)
    assert_follows(empirical([tuple(t) for t in outcomes], (VOCAB, VOCAB)), exact_first_two(target, PROMPT, params),
                   RUNS)
    # both branches of the rule are exercised: some first rounds accept a draft token, some reject all
    assert 0.05 < sum(rounds_with_rejection) / RUNS < 0.95
    if case == "bandit":  # every arm verified a good share of the batched rounds (one shape per round)
        assert all(s.pulls > 20 for s in kwargs["tree"].stats), [s.pulls for s in kwargs["tree"].stats]


def test_lookup_proposals_keep_sampling_exact(models):
    """Prompt-lookup rounds (lookup_tokens): a deterministic proposal is a point-mass draft distribution; the rule
    accepts it with the target's probability and otherwise samples the residual (p without the proposed token).
    Lookup rounds are a single-prompt feature: one call per run."""
    target, drafter = models
    prompt = [5, 3, 1, 5, 3]  # its last 2-gram recurs: every first round verifies [1, 5, ...]
    first_round_accepted, lookup_rounds = [], []

    def run(seed, rows):
        assert rows == 1
        result = generate(target, drafter, torch.tensor([prompt]), max_new_tokens=2, verifier="sampling", seed=seed,
                          tree="1,1", temperature=1.0, lookup_tokens=3)
        first_round_accepted.append(result.stats.accepted_lengths[0] > 1)
        lookup_rounds.append(result.stats.lookup_rounds)
        return result.new_tokens.tolist()

    outcomes = seeded_runs(run, LOOKUP_RUNS, 1)
    assert_follows(empirical([tuple(t) for t in outcomes], (VOCAB, VOCAB)),
                   exact_first_two(target, prompt, SamplingParams(1.0)), LOOKUP_RUNS)
    assert min(lookup_rounds) >= 1
    assert 0.05 < sum(first_round_accepted) / LOOKUP_RUNS < 0.95  # the proposal is accepted in some runs, rejected in others


def test_autoregressive_sampling_follows_the_target_distribution(models):
    """The baseline shares the sampler: same check (it has no rejection rule to get wrong)."""
    target, _ = models
    outcomes = seeded_runs(lambda seed, rows: generate_autoregressive(
        target, [PROMPT] * rows, max_new_tokens=2, temperature=1.0, seed=seed).new_tokens, RUNS, BATCH)
    assert_follows(empirical([tuple(t) for t in outcomes], (VOCAB, VOCAB)),
                   exact_first_two(target, PROMPT, SamplingParams(1.0)), RUNS)
