"""The `none` arm: a round without speculation (the root alone, one plain target decoding step).

Greedy output stays the target's own; the drafter skips those rounds and reads what they committed in one call when it
next drafts (checked against a from-scratch drafter forward); sampling keeps the target's law; a time-reward bandit
falls back to `none` when speculating is slow; prompt lookup, lossy verifiers, the Eq. 2 reward and the CLI take it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.sampling_law import assert_follows, empirical, tv_bound
from tests.helpers.tree_models import aligned_drafter, hf_greedy, prompts, random_drafter, tiny_llama
from tests.test_generate_cli import _run, cli_fp32, saved  # noqa: F401  (fixtures: fp32 CLI, saved pair)
from tree_search import Tree, TreeConfig, UCBBandit
from tree_search.tree_drafter import TreeDrafter
from tree_search.generate import generate, generate_autoregressive
from tree_search.sampling import SamplingParams, logits_to_probs, sample
from tree_search.verifiers import VerifyInput, get_verifier
from tree_search.verifiers.greedy import GreedyVerifier

VOCAB = 64
ARMS = ("none", "1,1", "1,1,1", "2,1")
# rounds switch between no speculation and chains / a small tree, with runs of none of several lengths
SCRIPT = (0, 0, 1, 0, 2, 2, 0, 0, 0, 3, 1, 0, 2, 0, 0, 3)


class Scripted(UCBBandit):
    """Pulls arms in a fixed cyclic order (so a test knows every round's arm); logs each pull."""

    def __init__(self, script=SCRIPT, arms=ARMS) -> None:
        super().__init__(arms=arms)
        self.script, self.pulled = script, []

    def select(self) -> int:
        arm = self.script[self.rounds % len(self.script)]
        self.pulled.append(arm)
        return arm


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB)
    return target, aligned_drafter(tmp_path_factory.mktemp("drafter"), target)


def test_none_is_the_tree_with_no_levels():
    none = TreeConfig.parse("none")
    assert none == TreeConfig(()) == TreeConfig.parse(" None ") == TreeConfig.parse(TreeConfig(()))
    assert str(none) == "none" and none.depth == 0 and none.num_nodes == 0 and none.level_sizes == ()
    assert none.build() == Tree((-1,)) and none.build().leaf_paths == ()
    with pytest.raises(ValueError, match="tree spec '' is empty: .*or 'none'"):
        TreeConfig.parse("")
    with pytest.raises(ValueError, match=r"tree spec \(\) is empty: for no speculation pass 'none'"):
        TreeConfig.parse(())  # an empty spec is refused in every form: no speculation is asked for by name
    with pytest.raises(ValueError, match="cannot parse tree spec 'nothing'"):
        TreeConfig.parse("nothing")
    assert list(UCBBandit(arms=("none", "1,1", "1,1,1"), reward="time").summary()) == ["none", "(1,1)", "(1,1,1)"]


def test_bandit_rewards_of_the_none_arm():
    paper = UCBBandit(arms=("none", "1,1"))
    assert paper.update(0, 1) == -1.0  # Eq. 2 with γ = 0: -(1 + λγ·0) / 1
    auto = UCBBandit(arms=("none", "1,1"), lambda_gamma="auto")
    auto.update(0, 1, 0.0, 0.01)  # no drafting: nothing to estimate the cost ratio from (and no division by γ = 0)
    assert auto.current_lambda_gamma == 0.0 and auto.summary()["none"]["mean_reward"] == -1.0
    auto.update(1, 3, 0.002, 0.01)
    assert auto.current_lambda_gamma == pytest.approx(0.1)  # (0.002 / 2 levels) / 0.01
    timed = UCBBandit(arms=("none", "1,1"), reward="time")
    timed.update(0, 1, 0.0, 0.01)
    timed.update(1, 3, 0.01, 0.02)
    assert timed.values() == pytest.approx([100 / 100, 100 / 100])  # 100 tok/s each, overall 4 tokens in 0.04 s


@pytest.mark.parametrize("max_new_tokens", [1, 7, 30])
def test_greedy_with_tree_none_is_the_targets_greedy_and_never_runs_the_drafter(pair, max_new_tokens):
    target, drafter = pair
    for prompt in prompts(VOCAB, 3, seed=max_new_tokens, min_len=1, max_len=9):
        result = generate(target, drafter, prompt, max_new_tokens=max_new_tokens, tree="none")
        assert torch.equal(result.tokens, hf_greedy(target, prompt, max_new_tokens))
        stats = result.stats
        assert stats.drafter_calls == 0 and stats.arms == {"none": {"pulls": max_new_tokens, "mean_reward": -1.0}}
        assert stats.rounds == max_new_tokens and stats.accepted_lengths == [1] * max_new_tokens
        assert stats.target_forwards == max_new_tokens + (prompt.shape[1] > 1)  # prefix prefill, then one per token


def run_scripted(pair, prompt, max_new_tokens, eos=None, prompt_lookup=False, script=SCRIPT, arms=ARMS):
    """Greedy generate under `Scripted`, recording the drafter's root logits per drafted round and its catch-ups."""
    target, drafter = pair
    policy = Scripted(script, arms)
    drafted, extended = [], []  # (round, root token, root logits) per drafted round; tokens fed per catch-up call
    # one prompt is a batch of one: trees draft through draft and catch up through extend; prompt lookup drafts its
    # chains with draft_chain_lookup and reads committed tokens through extend too
    draft_name = "draft_chain_lookup" if prompt_lookup else "draft"
    draft, extend = getattr(TreeDrafter, draft_name), TreeDrafter.extend

    def recording_draft(self, config, root, root_logits, *args):
        drafted.append((len(policy.pulled) - 1, int(root[0]), root_logits[0].clone()))
        return draft(self, config, root, root_logits, *args)

    def recording_extend(self, tokens):
        extended.append(tokens[0].tolist())
        return extend(self, tokens)

    patch = pytest.MonkeyPatch()
    patch.setattr(TreeDrafter, draft_name, recording_draft)
    patch.setattr(TreeDrafter, "extend", recording_extend)
    try:
        result = generate(target, drafter, prompt, max_new_tokens=max_new_tokens, tree=policy, eos_token_id=eos,
                          prompt_lookup=prompt_lookup)
    finally:
        patch.undo()
    return result, policy, drafted, extended


def check_drafter_in_sync(pair, prompt, result, drafted):
    """Every drafted round's root logits are the drafter's own after the committed text up to that round's root."""
    _, drafter = pair
    starts = [prompt.shape[1]]
    for n in result.stats.accepted_lengths:
        starts.append(starts[-1] + n)
    for round_, root, logits in drafted:
        prefix = result.tokens[:, : starts[round_]]
        assert root == int(prefix[0, -1])
        with torch.no_grad():
            expected = drafter.forward(prefix)[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_switching_between_none_and_speculation_stays_greedy_with_the_drafter_caught_up_in_one_call(pair):
    ended = Counter()
    for i, prompt in enumerate(prompts(VOCAB, 4, seed=3, min_len=1, max_len=10)):
        reference = hf_greedy(target := pair[0], prompt, 40)[0, prompt.shape[1]:].tolist()
        # the budget, and an EOS at several places of the greedy text: generation ends in rounds of every kind
        for max_new, eos in [(40 - i, None), (40, reference[5 + 3 * i]), (40, reference[17 + i])]:
            result, policy, drafted, extended = run_scripted(pair, prompt, max_new, eos)
            assert torch.equal(result.tokens, hf_greedy(target, prompt, max_new, eos_token_id=eos))
            ended[ARMS[policy.pulled[-1]] == "none"] += 1
            check_drafter_in_sync(pair, prompt, result, drafted)
            # deferred catch-up: one extend per drafted round after none rounds, with all their tokens
            arms = [ARMS[a] for a in policy.pulled]
            expected, behind, start = [], [], prompt.shape[1]
            for arm, n in zip(arms, result.stats.accepted_lengths):
                if arm != "none" and behind:
                    expected.append(behind)
                    behind = []
                if arm == "none":
                    behind = behind + result.tokens[0, start : start + n].tolist()
                start += n
            assert extended == expected and len(drafted) == sum(arm != "none" for arm in arms)
            assert result.stats.arms["none"]["pulls"] == arms.count("none") > 0
    assert ended[True] and ended[False]  # both a none round and a drafted round were the last one


def test_prompt_lookup_takes_a_none_arm(pair):
    repetitive = torch.tensor([[5, 9, 13, 2, 7, 30] * 5])
    chains = ("none", "1,1,1,1", "1,1")
    script = (0, 1, 0, 0, 2, 1, 1, 0)
    lookup, _, drafted, _ = run_scripted(pair, repetitive, 40, prompt_lookup=True, script=script, arms=chains)
    tree, *_ = run_scripted(pair, repetitive, 40, script=script, arms=chains)
    assert torch.equal(lookup.tokens, hf_greedy(pair[0], repetitive, 40)) and torch.equal(lookup.tokens, tree.tokens)
    assert lookup.stats.arms["none"]["pulls"] > 0 and lookup.stats.accepted_lengths == tree.stats.accepted_lengths
    assert tree.stats.drafter_calls - lookup.stats.drafter_calls == lookup.stats.drafter_calls_saved
    check_drafter_in_sync(pair, repetitive, lookup, drafted)


@pytest.mark.parametrize("verifier", ["greedy", "sampling", "fly", "topk", "dropmatch", "dropmatch+fly"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_verifier_picks_the_targets_own_token_on_a_root_only_tree(verifier, temperature):
    if verifier == "greedy" and temperature:
        pytest.skip("greedy is for temperature 0")
    torch.manual_seed(0)
    logits, hidden, head = torch.randn(1, 16), torch.randn(1, 8), torch.nn.Linear(8, 16, bias=False)
    params = SamplingParams(temperature, top_k=5 if temperature else 0)
    for seed in range(5):
        inp = VerifyInput(tree=TreeConfig(()).build(), tokens=torch.tensor([3]), target_logits=logits,
                          draft_probs=None, hidden=hidden, lm_head=head, sampling=params,
                          generator=torch.Generator().manual_seed(seed))
        result = get_verifier(verifier).verify(inp)
        own = logits[0].argmax() if params.greedy else \
            sample(logits_to_probs(logits, params), torch.Generator().manual_seed(seed))[0]
        assert result.path == [] and result.next_token == int(own) and result.lossy_accepts == 0


@pytest.mark.parametrize("verifier", ["fly", "topk", "dropmatch", "sampling"])
def test_a_none_arm_runs_with_every_verifier(pair, verifier):
    target, drafter = pair
    prompt = torch.tensor([[3, 17, 41, 8, 25]])
    result = generate(target, drafter, prompt, max_new_tokens=24, tree=Scripted(), verifier=verifier)
    assert result.stats.new_tokens == 24 and result.stats.arms["none"]["pulls"] > 0
    if verifier == "sampling":  # lossless at temperature 0
        assert torch.equal(result.tokens, hf_greedy(target, prompt, 24))


def test_tree_none_samples_exactly_as_the_autoregressive_baseline(pair):
    target, drafter = pair
    prompt = torch.tensor([[3, 17, 41]])
    for seed in range(3):
        kw = dict(max_new_tokens=30, temperature=1.3, top_k=20, seed=seed)
        none = generate(target, drafter, prompt, tree="none", **kw)
        assert torch.equal(none.tokens, generate_autoregressive(target, prompt, **kw).tokens)  # same draws, in order


def test_tree_none_first_token_follows_the_target_distribution(tmp_path):
    """TV between the empirical and the exact first-token law, bounded as in tests/helpers/sampling_law.py: about
    0.09 at N = 2,000 on 8 outcomes (one batch of 2,000 rows). Picking the argmax instead of sampling would give
    TV 1 - max p ≈ 0.4 here."""
    vocab, runs, prompt = 8, 2_000, [3, 5]
    target = tiny_llama(vocab=vocab, hidden=16, layers=1, seed=11, head_scale=3.0)
    drafter = random_drafter(tmp_path, vocab=vocab, hidden=16, layers=1, seed=12, head_scale=3.0)
    params = SamplingParams(0.9, top_k=6)
    with torch.no_grad():
        exact = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params).double()
    result = generate(target, drafter, [prompt] * runs, max_new_tokens=1, tree="none", temperature=0.9, top_k=6,
                      seed=0)
    assert_follows(empirical([(t[0],) for t in result.new_tokens], (vocab,)), exact, runs)
    assert 1 - exact.max().item() > 2 * tv_bound(exact, runs)  # the argmax alone would fail


class SlowGreedy(GreedyVerifier):
    """Greedy verification of drafted trees that takes PAUSE seconds more (a none round calls no verifier)."""

    PAUSE = 0.02

    def verify(self, inp):
        time.sleep(self.PAUSE)
        return super().verify(inp)


def test_a_time_reward_bandit_falls_back_to_none_when_speculating_is_slow(pair):
    target, drafter = pair
    prompt = torch.tensor([[3, 17, 41, 8, 25, 60, 12]])
    bandit = UCBBandit(arms=("none", "1,1", "1,1,1"), reward="time")
    result = generate(target, drafter, prompt, max_new_tokens=60, tree=bandit, verifier=SlowGreedy())
    assert torch.equal(result.tokens, hf_greedy(target, prompt, 60))
    pulls = {arm: s["pulls"] for arm, s in result.stats.arms.items()}
    assert pulls["none"] >= 0.75 * result.stats.rounds, pulls


def test_a_none_round_moves_one_token_to_the_host(pair, monkeypatch):
    loop = {"generate.py", "calls.py"}
    seen: Counter = Counter()
    for method in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code
            path = Path(caller.co_filename)
            if path.parent.name == "proposers" or path.parent.name == "tree_search" and path.name in loop:
                seen[caller.co_name, _method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    target, drafter = pair
    policy = Scripted()
    result = generate(target, drafter, torch.tensor([[3, 17, 41, 8]]), max_new_tokens=30, tree=policy)
    none = sum(ARMS[a] == "none" for a in policy.pulled)
    in_loop = Counter({key: n for key, n in seen.items() if not key[0].startswith("check_")})
    assert none and in_loop == Counter({("verify", "tolist"): result.stats.rounds})


def test_cli_tree_none_and_a_none_arm(saved, capsys):  # noqa: F811
    root, target, tokenizer = saved
    common = ("--target", root / "target", "--drafter", root / "drafter", "--prompt", "the cat sat on",
              "--max-new-tokens", 16)
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    expected = hf_greedy(target, prompt, 16)[0, prompt.shape[1]:].tolist()
    code, out = _run(capsys, *common, "--tree", "none", "--json")
    report = json.loads(out)
    assert code == 0 and report["tokens"] == expected and set(report["arms"]) == {"none"}
    assert report["drafter_calls"] == 0
    code, out = _run(capsys, *common, "--tree", "bandit-time:none/1,1/1,1,1")
    assert code == 0 and out.startswith(tokenizer.decode(expected))
    assert "tree none:" in out and "tree (1,1):" in out and "tree (1,1,1):" in out
    from tree_search.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {action.dest: action.help for action in parser._actions}
    assert "'none' drafts nothing" in helps["tree"] and "an arm 'none'" in helps["tree"]


def test_spec_round_trips_through_parse_and_bench_methods():
    from mamba_draft.benchmarks.methods import parse_method

    for spec in ("none", "3,2,1", "1"):
        assert TreeConfig.parse(spec).spec == spec
    assert parse_method("bandit-time:none/1,1").tree == "bandit-time:none/1,1"
    assert parse_method("none").tree == "none"
