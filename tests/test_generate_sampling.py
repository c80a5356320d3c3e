"""Sampling is lossless: the first two generated tokens follow the target's own processed distribution.

Setup: vocab-8 Llama target and an unrelated vocab-8 Mamba drafter (both with sharpened heads so p and q differ
a lot and rejections/residuals are exercised), a one-token prompt, 2 new tokens, N = 10,000 seeded runs per case (20,000 took 2.5 min per case on a 2-core EPYC).

Bound on the total-variation distance between the empirical and exact distributions over the K = 64 outcomes:
  E[TV] = ½ Σ_k E|p̂_k − p_k| ≤ ½ Σ_k sqrt(p_k (1 − p_k) / N)                    (Jensen, binomial variance)
  TV is a function of N independent runs, each changing it by at most 1/N, so by McDiarmid
  P(TV ≥ E[TV] + ε) ≤ exp(−2 N ε²);  ε = sqrt(ln(1/δ) / (2N)) with δ = 1e-6 gives 0.0263 at N = 10,000.
The test asserts TV < ½ Σ sqrt(p(1−p)/N) + ε (≈ 0.06 here): a lossless sampler fails it with probability < 1e-6.
Deliberately broken rules fail it by a wide margin (measured with this setup while writing the test, N = 4,000
runs; a broken rule's bias does not shrink with N, while the bound at N = 10,000 is ~0.06):
sampling the correction from p instead of the residual norm(max(p − q, 0)) gave TV 0.20 (chain) and 0.25 (wide
tree); not renormalising q after a rejected sibling (q_{i+1} = q_i) gave TV 0.13 on the wide tree.
"""
import math

import pytest
import torch

from tests.helpers.tree_models import random_drafter, tiny_llama
from tree_search import UCBBandit
from tree_search.generate import generate, generate_autoregressive
from tree_search.sampling import SamplingParams, logits_to_probs

VOCAB = 8
RUNS = 10_000  # bound ~0.06 at delta 1e-6; the deliberately broken rules measured 0.13-0.25
PROMPT = torch.tensor([[3]])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, head_scale=3.0)
    drafter = random_drafter(tmp_path_factory.mktemp("d"), vocab=VOCAB, hidden=16, layers=1, seed=12, head_scale=3.0)
    return target, drafter


def exact_first_two(target, params: SamplingParams, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """(V, V) exact P(x1, x2) under the target's processed distribution."""
    with torch.no_grad():
        first = logits_to_probs(target(prompt).logits[0, -1], params)
        seconds = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        second = logits_to_probs(target(seconds).logits[:, -1], params)
    return (first[:, None] * second).double()


def tv_bound(p: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    expected = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return expected + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical_first_two(run, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(n):
        tokens = run(seed)
        counts[tokens[0], tokens[1]] += 1
    return counts / n


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
    exact = exact_first_two(target, params)
    rounds_with_rejection = []

    def run(seed):
        result = generate(target, drafter, PROMPT, max_new_tokens=2, verifier="sampling", seed=seed, **kwargs)
        rounds_with_rejection.append(result.stats.accepted_lengths[0] == 1)
        return result.new_tokens[0].tolist()

    empirical = empirical_first_two(run, RUNS)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < tv_bound(exact, RUNS), f"TV {tv:.4f} vs bound {tv_bound(exact, RUNS):.4f}"
    # both branches of the rule are exercised: some first rounds accept a draft token, some reject all
    assert 0.05 < sum(rounds_with_rejection) / RUNS < 0.95
    if case == "bandit":
        assert all(s.pulls > 100 for s in kwargs["tree"].stats)  # every arm verified a good share of the runs


def test_lookup_proposals_keep_sampling_exact(models):
    """Prompt-lookup rounds (lookup_tokens): a deterministic proposal is a point-mass draft distribution; the rule
    accepts it with the target's probability and otherwise samples the residual (p without the proposed token)."""
    target, drafter = models
    prompt = torch.tensor([[5, 3, 1, 5, 3]])  # its last 2-gram recurs: every first round verifies [1, 5, ...]
    params = SamplingParams(1.0)
    exact = exact_first_two(target, params, prompt)
    first_round_accepted, lookup_rounds = [], []

    def run(seed):
        result = generate(target, drafter, prompt, max_new_tokens=2, verifier="sampling", seed=seed, tree="1,1",
                          temperature=1.0, lookup_tokens=3)
        first_round_accepted.append(result.stats.accepted_lengths[0] > 1)
        lookup_rounds.append(result.stats.lookup_rounds)
        return result.new_tokens[0].tolist()

    empirical = empirical_first_two(run, RUNS)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < tv_bound(exact, RUNS), f"TV {tv:.4f} vs bound {tv_bound(exact, RUNS):.4f}"
    assert min(lookup_rounds) >= 1
    assert 0.05 < sum(first_round_accepted) / RUNS < 0.95  # the proposal is accepted in some runs, rejected in others


def test_autoregressive_sampling_follows_the_target_distribution(models):
    """The baseline shares the sampler: same check, fewer runs (it has no rejection rule to get wrong)."""
    target, _ = models
    params = SamplingParams(1.0)
    exact = exact_first_two(target, params)
    n = 5_000
    empirical = empirical_first_two(
        lambda seed: generate_autoregressive(target, PROMPT, max_new_tokens=2, temperature=1.0, seed=seed)
        .new_tokens[0].tolist(), n)
    assert 0.5 * (empirical - exact).abs().sum().item() < tv_bound(exact, n)
