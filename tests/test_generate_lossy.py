"""generate() wiring of the lossy verifiers: per-rule lossy counts, early target checks, prompt lookup on chains."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tree_models import (
    aligned_drafter, hf_greedy, prompts, tiny_llama,
)
from tree_search.autojudge.classifier import JudgeHead
from tree_search.generate import generate
from tree_search.verifiers.base import Verifier, VerifyInput, VerifyResult
from tree_search.verifiers.greedy import GreedyVerifier

VOCAB, NEW_TOKENS = 64, 40
CHAIN = "1,1,1,1,1,1,1,1,1,1"
PROMPTS = prompts(VOCAB, 3, seed=4, min_len=3, max_len=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB)
    return target, aligned_drafter(tmp_path_factory.mktemp("drafter"), target)


def run(pair, prompt, **kw):
    target, drafter = pair
    return generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, **kw)


# ---------------------------------------------------------------- per-rule lossy counts


def test_lossy_accepts_are_counted_per_rule(pair):
    params = {"k": 3, "theta": 0.3, "window": 2}
    total_by: dict[str, int] = {}
    for prompt in PROMPTS:
        combo = run(pair, prompt, tree="2,2,1,1", verifier="topk+fly", verifier_params=params).stats
        assert set(combo.lossy_accepts_by) == {"topk", "fly"}
        assert combo.to_dict()["lossy_accepts_by"] == combo.lossy_accepts_by
        # every lossy node is accepted by at least one rule; a node both rules accept counts for both
        assert max(combo.lossy_accepts_by.values()) <= combo.lossy_accepts <= sum(combo.lossy_accepts_by.values())
        for name, count in combo.lossy_accepts_by.items():
            total_by[name] = total_by.get(name, 0) + count
        single = run(pair, prompt, tree="2,2,1,1", verifier="topk", verifier_params={"k": 3}).stats
        assert single.lossy_accepts_by == {"topk": single.lossy_accepts}
    assert total_by["topk"] > 0 and total_by["fly"] > 0


class CountsWithoutBreakdown(Verifier):
    """Reports lossy_accepts but no per-rule breakdown: greedy paths, with their first node called lossy."""

    name, lossless, draft_mode = "plain-lossy", False, "topk"

    def verify(self, inp: VerifyInput) -> VerifyResult:
        result = GreedyVerifier().verify(inp)
        return VerifyResult(result.path, result.next_token, lossy_accepts=min(len(result.path), 1))


def test_a_verifier_without_breakdown_counts_under_its_own_name(pair):
    stats = run(pair, PROMPTS[0], tree="2,2,1", verifier=CountsWithoutBreakdown()).stats
    assert stats.lossy_accepts > 0 and stats.lossy_accepts_by == {"plain-lossy": stats.lossy_accepts}
    assert run(pair, PROMPTS[0], tree="2,2,1").stats.lossy_accepts_by == {}  # lossless: nothing to count


# ---------------------------------------------------------------- refusals before any model runs


@pytest.fixture
def counted(pair, monkeypatch):
    """The pair with counters on every target forward and every drafter prefill/step/extend."""
    target, drafter = pair
    calls = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append("target"))
    for method in ("prefill", "step", "extend"):
        monkeypatch.setattr(type(drafter), method, lambda *a, **k: calls.append("drafter"))
    yield target, drafter, calls
    handle.remove()


def test_judge_for_another_hidden_size_is_refused_before_any_model_runs(counted, tmp_path):
    target, drafter, calls = counted
    JudgeHead(torch.zeros(16), torch.ones(16), torch.ones(16), torch.zeros(1)).save(tmp_path / "other.safetensors")
    for name, params in (("autojudge", {}), ("dropmatch+autojudge", {"p": 0.1})):
        with pytest.raises(ValueError, match="hidden size 16, but LlamaForCausalLM has hidden size 32"):
            generate(target, drafter, PROMPTS[0], max_new_tokens=5, tree="2,1", verifier=name,
                     verifier_params={**params, "judge": str(tmp_path / "other.safetensors"), "threshold": 0.5})
    assert calls == []


@pytest.mark.parametrize("change, message", [
    (dict(tree="3,1,1"), r"chains only .* tree arm\(s\) \(3,1,1\) branch"),
    (dict(tree="bandit"), "chains only"),
    (dict(tree=CHAIN, temperature=0.7, verifier="sampling"), "needs temperature 0"),
    (dict(tree=CHAIN, prompt_lookup="yes"), "prompt_lookup must be True or False"),
])
def test_prompt_lookup_refuses_trees_and_sampling_before_any_work(counted, change, message):
    target, drafter, calls = counted
    kwargs = {"prompt_lookup": True, **change}
    with pytest.raises((ValueError, TypeError), match=message):
        generate(target, drafter, PROMPTS[0], max_new_tokens=5, **kwargs)
    assert calls == []


# ---------------------------------------------------------------- prompt lookup in the chain loop

VERIFIERS = [
    ("greedy", None),
    ("fly", {"theta": 0.3, "window": 2}),
    ("dropmatch", {"p": 0.1, "criterion": "js", "seed": 3}),  # reads the recorded draft probabilities
]


@pytest.mark.parametrize("verifier, params", VERIFIERS, ids=[v for v, _ in VERIFIERS])
def test_prompt_lookup_changes_drafter_calls_not_output(pair, verifier, params):
    saved = 0
    for prompt in PROMPTS:
        plain = run(pair, prompt, tree=CHAIN, verifier=verifier, verifier_params=params)
        lookup = run(pair, prompt, tree=CHAIN, verifier=verifier, verifier_params=params, prompt_lookup=True)
        assert torch.equal(lookup.tokens, plain.tokens)
        if verifier == "greedy":
            assert torch.equal(lookup.tokens, hf_greedy(pair[0], prompt, NEW_TOKENS))
        # same drafts every round (so row 0's committed state survived the scratch drafting), same decisions
        assert lookup.stats.accepted_lengths == plain.stats.accepted_lengths
        assert lookup.stats.lossy_accepts_by == plain.stats.lossy_accepts_by
        assert plain.stats.drafter_calls_saved == 0
        assert plain.stats.drafter_calls - lookup.stats.drafter_calls == lookup.stats.drafter_calls_saved
        saved += lookup.stats.drafter_calls_saved
    if verifier == "fly":  # long lossy acceptances make the text repetitive: lookup proposals then pay off
        assert saved > 0


def test_prompt_lookup_with_a_chain_bandit_and_a_one_token_chain(pair):
    prompt = PROMPTS[1]
    reference = hf_greedy(pair[0], prompt, NEW_TOKENS)
    for tree in ("1", [1, 1, 1]):  # one drafted token needs scratch rows beyond the tree's own two
        assert torch.equal(run(pair, prompt, tree=tree, prompt_lookup=True).tokens, reference)
    from tree_search import UCBBandit

    bandit = UCBBandit(arms=("1,1", "1,1,1,1,1,1"))
    result = run(pair, prompt, tree=bandit, prompt_lookup=True)
    assert torch.equal(result.tokens, reference) and len(result.stats.arms) == 2
