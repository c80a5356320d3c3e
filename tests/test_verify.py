"""Verifiers in isolation: greedy walk, the multi-candidate rejection rule's output law, registry errors."""
import math

import pytest
import torch

from mamba_draft.tree import TreeConfig
from tree_search.sampling import SamplingParams, logits_to_probs, sample_without_replacement
from tree_search.verifiers import (
    GreedyVerifier, SamplingVerifier, Verifier, VerifyInput, available_verifiers, get_verifier, register_verifier,
    verifier_class,
)


def _input(tree, tokens, target_logits, draft_probs=None, params=SamplingParams(), generator=None, mode="topk"):
    return VerifyInput(tree=tree, tokens=torch.tensor(tokens), target_logits=target_logits, draft_probs=draft_probs,
                       hidden=None, lm_head=None, sampling=params, generator=generator, draft_mode=mode)


def test_greedy_follows_the_target_argmax_down_the_tree():
    tree = TreeConfig((2, 2)).build()  # nodes 1,2 at depth 1; 3,4 under 1; 5,6 under 2
    tokens = [9, 4, 7, 1, 2, 3, 5]
    choice = [7, 0, 5, 0, 0, 0, 0]  # target wants 7 after the root (node 2), then 5 (node 6), then 0
    logits = torch.nn.functional.one_hot(torch.tensor(choice), 10).float()
    result = GreedyVerifier().verify(_input(tree, tokens, logits))
    assert result.path == [2, 6] and result.next_token == 0
    choice[2] = 8  # no child of node 2 matches: stop there with the target's own token
    result = GreedyVerifier().verify(_input(tree, tokens, torch.nn.functional.one_hot(torch.tensor(choice), 10).float()))
    assert result.path == [2] and result.next_token == 8


def _output_law(draws, verify, vocab):
    counts = torch.zeros(vocab)
    for seed in range(draws):
        counts[verify(seed)] += 1
    return counts / draws


@pytest.mark.parametrize("k, mode", [(1, "sample"), (3, "sample"), (3, "topk")])
def test_root_rule_outputs_exactly_the_target_distribution(k, mode):
    """At one node, the token the rule emits (accepted child or residual sample) is distributed as p."""
    torch.manual_seed(0)
    vocab = 6
    params = SamplingParams(temperature=1.0)
    target_logits = torch.randn(1 + k, vocab) * 2
    q = logits_to_probs(torch.randn(vocab) * 2, params)
    p = logits_to_probs(target_logits[0], params)
    tree = TreeConfig((k,)).build()

    def verify(seed):
        g = torch.Generator().manual_seed(seed)
        kids = sample_without_replacement(q, k, g) if mode == "sample" else torch.topk(q, k).indices
        draft = torch.zeros(1 + k, vocab)
        draft[0] = q
        result = SamplingVerifier().verify(_input(tree, [0, *kids.tolist()], target_logits, draft, params, g, mode))
        return int(kids[result.path[0] - 1]) if result.path else result.next_token

    n = 3000
    law = _output_law(n, verify, vocab)
    # E[TV] <= ½ Σ sqrt(p(1-p)/n); plus McDiarmid's margin sqrt(ln(1/δ) / 2n) at δ = 1e-6
    bound = 0.5 * torch.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1e6) / (2 * n))
    assert 0.5 * (law - p).abs().sum() < bound


def test_zero_probability_padding_children_are_skipped():
    """q supported on one token but 3 children drawn: the 2 padding children must not be accepted as if q were 0."""
    vocab = 5
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    target_logits = torch.zeros(4, vocab)  # p uniform
    tree = TreeConfig((3,)).build()

    def verify(seed):
        g = torch.Generator().manual_seed(seed)
        kids = sample_without_replacement(q, 3, g)
        assert kids[0] == 1
        draft = torch.zeros(4, vocab)
        draft[0] = q
        result = SamplingVerifier().verify(_input(tree, [0, *kids.tolist()], target_logits, draft, params, g, "sample"))
        return int(kids[result.path[0] - 1]) if result.path else result.next_token

    law = _output_law(2000, verify, vocab)
    assert (law - 0.2).abs().max() < 0.06  # 6.7 binomial standard deviations (0.0089 each)


def test_sampling_verifier_at_temperature_zero_is_greedy():
    tree = TreeConfig((2, 1)).build()
    logits = torch.nn.functional.one_hot(torch.tensor([3, 0, 1, 0, 4]), 6).float()
    result = SamplingVerifier().verify(_input(tree, [0, 2, 3, 7, 1], logits))
    assert result.path == [2, 4] and result.next_token == 4


def test_sampling_verifier_needs_draft_probs_at_positive_temperature():
    tree = TreeConfig((1,)).build()
    with pytest.raises(ValueError, match="draft_probs"):
        SamplingVerifier().verify(_input(tree, [0, 1], torch.zeros(2, 4), None, SamplingParams(1.0)))


def test_registry():
    names = available_verifiers()
    assert {"greedy", "sampling"} <= set(names)
    assert isinstance(get_verifier("greedy"), GreedyVerifier)
    assert get_verifier("sampling").lossless and get_verifier("sampling").draft_mode == "sample"
    instance = SamplingVerifier()
    assert get_verifier(instance) is instance
    with pytest.raises(ValueError, match="unknown verifier 'nope'; available: .*greedy"):
        get_verifier("nope")
    with pytest.raises(ValueError, match="non-empty"):
        get_verifier("")


def test_verifier_class_and_parameter_checks():
    from tree_search.verifiers.fly import FLyVerifier

    assert verifier_class("greedy") is GreedyVerifier and verifier_class("fly") is FLyVerifier
    with pytest.raises(ValueError, match="unknown verifier 'nope'; available: .*greedy"):
        verifier_class("nope")
    assert get_verifier("fly", **{"fly.theta": 0.7}, window=3).theta == 0.7  # '<name>.key' works on a single verifier
    with pytest.raises(ValueError, match="verifier 'fly' does not take 'foo'; it takes theta, window, entropy"):
        get_verifier("fly", foo=1)
    with pytest.raises(ValueError, match="verifier 'greedy' does not take 'k'; it takes no parameters"):
        get_verifier("greedy", k=1)
    with pytest.raises(ValueError, match="does not take 'topk.k'"):  # another verifier's prefix is not stripped
        get_verifier("fly", **{"topk.k": 2})


def test_register_verifier_validates_declarations():
    with pytest.raises(ValueError, match="draft_mode"):
        @register_verifier
        class Bad(Verifier):
            name, lossless, draft_mode = "bad-mode", True, "beam"
    with pytest.raises(TypeError, match="lossless"):
        @register_verifier
        class Missing(Verifier):
            name, draft_mode = "missing", "topk"
    with pytest.raises(ValueError, match="already registered"):
        @register_verifier
        class Clash(Verifier):
            name, lossless, draft_mode = "greedy", True, "topk"


def test_logits_to_probs_processing():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.equal(logits_to_probs(logits, SamplingParams()), torch.tensor([1.0, 0, 0, 0]))
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([1, torch.e**-1, 0, 0]) / (1 + torch.e**-1))
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))  # p ≈ .64,.24,.09,.03: keep 2
    assert (nucleus > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(nucleus.sum(), torch.tensor(1.0))
