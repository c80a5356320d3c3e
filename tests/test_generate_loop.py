"""The shape of `generate`'s loop: one device -> host transfer per round, phase times that fit in the total (read
once per round), drafting strategies that are interchangeable, and the shared setup / ending (streamer, errors)."""
from __future__ import annotations

import importlib
import sys
import time
from collections import Counter
from itertools import accumulate
from pathlib import Path

import pytest
import torch

from tests.helpers.tree_models import aligned_drafter, hf_greedy, tiny_llama
from tree_search import UCBBandit
from tree_search.calls import Recorder
from tree_search.generate import generate, generate_autoregressive
from tree_search.tree_drafter import TreeDrafter
from tree_search.verifiers.greedy import GreedyVerifier

NEW_TOKENS = 40
CHAIN = "1,1,1,1,1"
PROMPT = torch.tensor([[3, 17, 41, 8, 25, 60, 12]])
REPETITIVE = torch.tensor([[5, 9, 13, 2, 7, 30] * 5])
LOOP_FILES = {"generate.py", "calls.py", "proposers"}  # tree_search's loop modules; every proposer
TRANSFERS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")  # every way a value reaches the host
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_llama(vocab=64)
    return target, aligned_drafter(tmp_path_factory.mktemp("drafter"), target)


def on(pair, device: str):
    target, drafter = pair
    return target.to(device), drafter.to(device)


@pytest.fixture
def transfers(monkeypatch):
    """Counts tensor -> Python conversions made directly by the generate loop's own modules, by (function, method)."""
    seen: Counter = Counter()
    for method in TRANSFERS:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            caller = sys._getframe(1).f_code
            path = Path(caller.co_filename)
            if path.parent.name == "proposers" or path.parent.name == "tree_search" and path.name in LOOP_FILES:
                seen[caller.co_name, _method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return seen


def in_the_loop(seen: Counter) -> Counter:
    """Drop the input checks' conversions (they run once, before any model)."""
    return Counter({key: n for key, n in seen.items() if not key[0].startswith("check_")})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [
    dict(tree="3,2,1"),
    dict(tree="bandit"),
    dict(tree="3,2,1", temperature=1.0, seed=0),  # sampled drafts, the sampling verifier
    dict(tree=CHAIN, prompt_lookup=True),
], ids=["tree", "bandit", "sampling", "lookup"])
def test_the_loop_moves_the_accepted_tokens_to_the_host_once_per_round(pair, transfers, device, kw):
    target, drafter = on(pair, device)
    result = generate(target, drafter, PROMPT.to(device), max_new_tokens=NEW_TOKENS, **kw)
    assert result.stats.rounds > 5 and result.stats.new_tokens == NEW_TOKENS
    assert in_the_loop(transfers) == Counter({("verify", "tolist"): result.stats.rounds})


@pytest.mark.parametrize("device", DEVICES)
def test_the_autoregressive_loop_moves_one_token_per_round(pair, transfers, device):
    target, _ = on(pair, device)
    result = generate_autoregressive(target, PROMPT.to(device), max_new_tokens=NEW_TOKENS)
    assert in_the_loop(transfers) == Counter({("decode_plainly", "tolist"): NEW_TOKENS})


class SlowGreedy(GreedyVerifier):
    """Greedy verification that takes at least PAUSE seconds, so verification time has a known floor."""

    PAUSE = 0.003

    def verify(self, inp):
        time.sleep(self.PAUSE)
        return super().verify(inp)


@pytest.mark.parametrize("device", DEVICES)
def test_phase_times_fit_in_the_total_and_the_policy_is_charged_whole_rounds(pair, monkeypatch, device):
    target, drafter = on(pair, device)
    bandit = UCBBandit(arms=("3,2,1", CHAIN), reward="time")
    charged = []
    update = bandit.update

    def recording_update(arm, n_accept, draft_time=None, verify_time=None):
        charged.append((draft_time, verify_time))
        return update(arm, n_accept, draft_time, verify_time)

    monkeypatch.setattr(bandit, "update", recording_update)
    stats = generate(target, drafter, PROMPT.to(device), max_new_tokens=NEW_TOKENS, tree=bandit,
                     verifier=SlowGreedy()).stats
    assert len(charged) == stats.rounds > 5 and min(min(times) for times in charged) >= 0
    assert stats.verify_time >= SlowGreedy.PAUSE * stats.rounds  # the pause lands in the verify phase
    assert stats.draft_time > 0 and stats.other_time > 0
    assert stats.draft_time + stats.verify_time <= stats.total_time
    # whole rounds: the stats' phases plus commit and bookkeeping, all within the call
    whole = sum(d + v for d, v in charged)
    assert stats.draft_time + stats.verify_time <= whole + 1e-9 and whole <= stats.total_time

    baseline = generate_autoregressive(target, PROMPT.to(device), max_new_tokens=NEW_TOKENS).stats
    assert baseline.draft_time == 0 and 0 < baseline.verify_time <= baseline.total_time


class HostEvent:
    """torch.cuda.Event's timing API on the host clock, counting waits (the GPU path of the recorder, on CPU)."""

    waits = 0

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        HostEvent.waits += 1

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, like CUDA events


def test_the_recorder_waits_on_its_events_once_per_round(pair, monkeypatch):
    class EventRecorder(Recorder):
        def __init__(self, stats, device):
            super().__init__(stats, device)
            self.events = [HostEvent() for _ in self.clock]

    monkeypatch.setattr(importlib.import_module("tree_search.calls"), "Recorder", EventRecorder)
    monkeypatch.setattr(HostEvent, "waits", 0)
    target, drafter = on(pair, "cpu")
    stats = generate(target, drafter, PROMPT, max_new_tokens=NEW_TOKENS, tree="3,2,1", verifier=SlowGreedy()).stats
    assert HostEvent.waits == stats.rounds > 5
    assert stats.verify_time >= SlowGreedy.PAUSE * stats.rounds and stats.draft_time > 0
    assert stats.draft_time + stats.verify_time <= stats.total_time
    HostEvent.waits = 0
    baseline = generate_autoregressive(target, PROMPT, max_new_tokens=NEW_TOKENS).stats
    assert HostEvent.waits == NEW_TOKENS - 1 and 0 < baseline.verify_time <= baseline.total_time  # one per decode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_cuda_events_are_read_once_per_round_and_the_device_synchronized_once_per_call(pair, monkeypatch):
    target, drafter = on(pair, "cuda")
    generate(target, drafter, PROMPT.cuda(), max_new_tokens=NEW_TOKENS, tree="3,2,1")  # graphs captured before counting
    waits = Counter()
    event_wait, device_wait = torch.cuda.Event.synchronize, torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: waits.update(["event"]) or event_wait(self))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.update(["device"]) or device_wait(*a))
    stats = generate(target, drafter, PROMPT.cuda(), max_new_tokens=NEW_TOKENS, tree="3,2,1").stats
    assert waits == Counter(event=stats.rounds, device=1)
    assert 0 < stats.draft_time + stats.verify_time <= stats.total_time


def test_lookup_and_tree_drafting_give_the_same_greedy_output_on_a_repetitive_prompt(pair, monkeypatch):
    target, drafter = on(pair, "cpu")
    lookups = []  # (context the lookup searched, lookup tokens it proposed) per round
    draft_chain_lookup = TreeDrafter.draft_chain_lookup

    def recording(self, config, root, root_logits, context, record_probs):
        buf, lookup = draft_chain_lookup(self, config, root, root_logits, context, record_probs)
        lookups.append((context.clone(), lookup.proposed))
        return buf, lookup

    monkeypatch.setattr(TreeDrafter, "draft_chain_lookup", recording)
    tree = generate(target, drafter, REPETITIVE, max_new_tokens=NEW_TOKENS, tree=CHAIN)
    lookup = generate(target, drafter, REPETITIVE, max_new_tokens=NEW_TOKENS, tree=CHAIN, prompt_lookup=True)
    assert torch.equal(lookup.tokens, tree.tokens)
    assert torch.equal(tree.tokens, hf_greedy(target, REPETITIVE, NEW_TOKENS))
    assert lookup.stats.accepted_lengths == tree.stats.accepted_lengths  # the same chain every round
    assert sum(proposed for _, proposed in lookups) > 0  # the repetition did give lookup proposals to check
    assert tree.stats.drafter_calls - lookup.stats.drafter_calls == lookup.stats.drafter_calls_saved
    # the context kept in place is the committed text up to each round's root
    prompt = REPETITIVE.shape[1]
    rounds = lookup.stats.accepted_lengths
    assert [len(context) for context, _ in lookups] == list(accumulate(rounds[:-1], initial=prompt))
    for context, _ in lookups:
        assert torch.equal(context, lookup.tokens[0, : len(context)])


class RecordingStreamer:
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, tokens):
        self.puts.append(tokens.tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("kind", ["speculative", "autoregressive"])
def test_the_streamer_gets_the_prompt_then_each_rounds_tokens_then_one_end(pair, kind):
    target, drafter = on(pair, "cpu")
    streamer = RecordingStreamer()
    if kind == "speculative":
        result = generate(target, drafter, PROMPT, max_new_tokens=NEW_TOKENS, tree="3,2,1", streamer=streamer)
    else:
        result = generate_autoregressive(target, PROMPT, max_new_tokens=NEW_TOKENS, streamer=streamer)
    assert streamer.puts[0] == PROMPT[0].tolist() and streamer.ends == 1
    assert [len(p) for p in streamer.puts[1:]] == result.stats.accepted_lengths
    assert sum(streamer.puts, []) == result.tokens[0].tolist()


def test_generate_without_a_drafter_points_to_the_baseline(pair):
    with pytest.raises(TypeError, match="generate_autoregressive is the baseline"):
        generate(pair[0], None, PROMPT, max_new_tokens=5)
