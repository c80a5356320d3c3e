"""Lossy verifiers end to end through `tree_search.generate` on a tiny target / Mamba drafter pair."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.tree_models import aligned_drafter, hf_greedy, prompts, tiny_llama
from tree_search.autojudge.classifier import JudgeHead
from tree_search.generate import generate
from tree_search.verifiers import get_verifier
from tree_search.verifiers.base import Verifier, VerifyInput, VerifyResult
from tree_search.verifiers.greedy import GreedyVerifier

VOCAB, NEW_TOKENS, TREE = 64, 20, "2,2,1,1,1"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB)
    drafter = aligned_drafter(tmp_path_factory.mktemp("drafter"), target, mixing_scale=0.5)  # disagrees often
    return target, drafter


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """A random (untrained) AutoJudge head for the tiny target: P(important) spreads around 0.5."""
    g = torch.Generator().manual_seed(0)
    head = JudgeHead(torch.zeros(32), torch.ones(32), torch.randn(32, generator=g) * 0.5, torch.zeros(1))
    path = tmp_path_factory.mktemp("judge") / "judge.safetensors"
    head.save(path)
    return str(path)


PROMPTS = prompts(VOCAB, 2, seed=4, min_len=3, max_len=8)


def run(pair, verifier, **kw):
    target, drafter = pair
    return [generate(target, drafter, p, max_new_tokens=NEW_TOKENS, tree=TREE, verifier=verifier, **kw) for p in PROMPTS]


@pytest.fixture(scope="module")
def greedy_runs(pair):
    runs = run(pair, "greedy")
    for prompt, result in zip(PROMPTS, runs):  # the lossless reference is the target's own greedy output
        assert torch.equal(result.tokens, hf_greedy(pair[0], prompt, NEW_TOKENS))
    return runs


IDENTITIES = [
    ("dropmatch", {"p": 0.0, "criterion": "naive"}),
    ("dropmatch", {"p": 0.0, "criterion": "js"}),
    ("fly", {"theta": math.inf, "window": 2}),
    ("topk", {"k": 1}),
    ("autojudge", {"threshold": 0.0}),
]


@pytest.mark.parametrize("name, params", IDENTITIES, ids=[f"{n}-{p}" for n, p in IDENTITIES])
def test_degenerate_settings_are_token_identical_to_greedy(pair, greedy_runs, judge, name, params):
    if name == "autojudge":
        params = {**params, "judge": judge}
    for reference, result in zip(greedy_runs, run(pair, name, verifier_params=params)):
        assert torch.equal(result.tokens, reference.tokens)
        assert result.stats.lossy_accepts == 0 and not result.stats.lossless


class AgainstGreedy(Verifier):
    """Runs a lossy verifier and, on the very same tree, the greedy verifier; records both path lengths."""

    draft_mode = "topk"

    def __init__(self, inner: Verifier):
        self.inner, self.name, self.lossless = inner, inner.name, inner.lossless
        self.needs_hidden, self.needs_draft_probs = inner.needs_hidden, inner.needs_draft_probs
        self.lengths: list[tuple[int, int]] = []
        self.lossy = 0

    def verify(self, inp: VerifyInput) -> VerifyResult:
        result = self.inner.verify(inp)
        self.lengths.append((len(result.path), len(GreedyVerifier().verify(inp).path)))
        self.lossy += result.lossy_accepts
        assert sum(result.info["lossy_accepts_by"].values()) >= result.lossy_accepts
        return result


LOSSY = [
    ("fly", {"theta": 0.3, "window": 2}),
    ("topk", {"k": 3}),
    ("dropmatch", {"p": 0.3, "criterion": "naive"}),
    ("dropmatch", {"p": 0.1, "criterion": "js"}),
    ("autojudge", {"threshold": 0.5}),
    ("autojudge+dropmatch", {"threshold": 0.2, "p": 0.2, "criterion": "naive"}),
]


@pytest.mark.parametrize("name, params", LOSSY, ids=[f"{n}-{p}" for n, p in LOSSY])
def test_lossy_accepts_at_least_greedy_and_raises_tau(pair, greedy_runs, judge, name, params):
    if name.startswith("autojudge"):
        params = {**params, "judge": judge}
    recorder = AgainstGreedy(get_verifier(name, **params))
    results = run(pair, recorder)
    assert all(lossy >= exact for lossy, exact in recorder.lengths)  # per round, on identical inputs
    assert recorder.lossy > 0 and sum(r.stats.lossy_accepts for r in results) == recorder.lossy
    pooled = lambda runs: sum(r.stats.new_tokens for r in runs) / sum(r.stats.rounds for r in runs)  # noqa: E731
    assert pooled(results) >= pooled(greedy_runs)


def test_results_reproducible_with_a_seed(pair):
    target, drafter = pair
    once = lambda verifier, **kw: generate(target, drafter, PROMPTS[0], max_new_tokens=12, tree=TREE, verifier=verifier, **kw)  # noqa: E731
    dropmatch = {"p": 0.3, "criterion": "naive", "seed": 7}
    assert torch.equal(once("dropmatch", verifier_params=dropmatch).tokens, once("dropmatch", verifier_params=dropmatch).tokens)
    sampled = dict(verifier_params={"theta": 0.3, "window": 2}, temperature=1.0, seed=11)
    assert torch.equal(once("fly", **sampled).tokens, once("fly", **sampled).tokens)


def test_judge_for_another_target_is_refused(pair, tmp_path):
    head = JudgeHead(torch.zeros(16), torch.ones(16), torch.ones(16), torch.zeros(1))
    head.save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="trained on hidden size 16"):
        run(pair, "autojudge", verifier_params={"judge": str(tmp_path / "other.safetensors"), "threshold": 0.5})
