"""generate / generate_autoregressive on a batch: B prompts decoded together give, per row, exactly what the target's
own `generate` (greedy) or `generate` with that row's seed (sampling) gives that prompt alone; rows stop on their own
EOS / budget and leave the batch; the policy sees the batch; bad batches are refused before any model runs."""

import pytest
import torch

from mamba_draft import transformer as transformer_module
from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.tree_mask import check_tree_support
from mamba_draft.transformer import TransformerDrafter
from tests.helpers.sampling_law import assert_follows, exact_first_two
from tests.helpers.tree_models import aligned_drafter, hf_greedy, random_drafter, tiny_llama
from tree_search import UCBBandit
from tree_search.calls import Call
from tree_search.tree_drafter import TreeDrafter
from tree_search.generate import SpeculativeDecoder, generate, generate_autoregressive
from tree_search.sampling import SamplingParams
from tree_search.verifiers.greedy import GreedyVerifier

VOCAB = 64
NEW = 40
LENGTHS = (5, 1, 9, 3, 12)  # different lengths, one single-token prompt (its target prefix is all padding)


@pytest.fixture(scope="module")
def greedy_setup(tmp_path_factory):
    target = tiny_llama()
    drafter = aligned_drafter(tmp_path_factory.mktemp("aligned"), target)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [hf_greedy(target, torch.tensor([p]), NEW) for p in prompts]
    return target, drafter, prompts, refs


def left_padded(prompts, pad: int = 7):
    """(B, L) ids whose pads hold a real token id (a pad that leaks changes the output) and their mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def none_and_chains():
    return UCBBandit(arms=("none", "1,1", "3,2,1"), lambda_ucb=2.0)  # strong exploration: every arm is pulled


@pytest.mark.parametrize("tree", ["1,1,1,1", "3,2,1", "4", "none", "bandit", "none+chains"])
def test_greedy_rows_equal_the_targets_generate(greedy_setup, tree):
    target, drafter, prompts, refs = greedy_setup
    policy = none_and_chains() if tree == "none+chains" else tree
    result = generate(target, drafter, prompts, max_new_tokens=NEW, tree=policy)
    for b, (row, ref) in enumerate(zip(result.rows, refs)):
        assert torch.equal(row.tokens, ref), f"row {b} diverged"
        assert row.stats.new_tokens == NEW == sum(row.stats.accepted_lengths)
    stats = result.stats
    assert stats.new_tokens == NEW * len(prompts) and sum(stats.accepted_lengths) == stats.new_tokens
    assert stats.target_forwards == stats.rounds + 1  # the prefill, then one forward per round for the whole batch
    arms = stats.arms
    assert sum(arm["pulls"] for arm in arms.values()) == stats.rounds  # one arm per round for the whole batch
    if tree == "none+chains":
        assert all(arm["pulls"] > 0 for arm in arms.values())  # switched between none and drafted rounds
    if tree in ("3,2,1", "bandit"):
        assert min(result.mean_accepted) > 1.5  # the aligned drafter is accepted in every row


def test_padded_tensor_input_and_time_reward(greedy_setup):
    """Left-padded (B, L) ids + attention_mask give the same rows; the time reward sees the batch's throughput."""
    target, drafter, prompts, refs = greedy_setup
    ids, mask = left_padded(prompts)
    policy = UCBBandit(arms=("none", "1,1,1", "3,2,1"), reward="time")
    result = generate(target, drafter, ids, attention_mask=mask, max_new_tokens=NEW, tree=policy)
    assert all(torch.equal(row.tokens, ref) for row, ref in zip(result.rows, refs))
    assert sum(s.pulls for s in policy.stats) == result.stats.rounds
    # rewarded with every row's tokens (those a row's last round proposed past its budget included)
    assert policy._tokens == result.stats.new_tokens + sum(row.stats.cut_tokens for row in result.rows)


def test_eos_and_budget_land_mid_round_in_different_rows(greedy_setup, monkeypatch):
    """Rows end on EOS or on max_new_tokens in different rounds, inside accepted paths; each finished row leaves the
    target batch (every later forward is over the unfinished rows only)."""
    target, drafter, prompts, refs = greedy_setup
    new = [ref[0, len(p):].tolist() for p, ref in zip(prompts, refs)]
    eos = new[0][11]  # row 0 ends on it mid-way; some rows never emit it
    budget = 33
    expected = [hf_greedy(target, torch.tensor([p]), budget, eos_token_id=eos)[0, len(p):].tolist() for p in prompts]
    assert {len(e) for e in expected} != {budget} and budget in {len(e) for e in expected}
    batches = []
    forward = TargetCache.tree_forward

    def spy(self, tokens, tree, want_hidden=False):
        batches.append(tokens.shape[0])
        return forward(self, tokens, tree, want_hidden)

    decoder = SpeculativeDecoder(target, drafter, tree="3,2,1")
    check_tree_support(target, decoder.tree_mask_ok)  # the tree-mask probe's forwards: before the spy
    monkeypatch.setattr(TargetCache, "tree_forward", spy)
    result = decoder.generate(prompts, max_new_tokens=budget, eos_token_id=eos)
    assert result.new_tokens == expected
    rounds = [row.stats.rounds for row in result.rows]
    assert len(set(rounds)) > 1  # rows finished in different rounds
    assert any(row.stats.cut_tokens for row in result.rows)  # a round proposed tokens past a row's EOS / budget
    assert batches == [sum(r > i for r in rounds) for i in range(len(batches))]  # finished rows cost nothing more


def test_none_rounds_leave_the_drafter_to_one_catch_up_call(greedy_setup, monkeypatch):
    """Scripted runs of none rounds of several lengths, rows ending on EOS among them: the drafter reads nothing during
    none rounds (not even the prompts, until the first drafted round), then one (B, k) call per drafted round after
    them, whose logits are a from-scratch drafter encoding of each active row's committed text (so it stays in sync
    across compaction); the rows stay the target's greedy."""
    from tests.test_no_speculation import ARMS, Scripted

    target, drafter, prompts, refs = greedy_setup
    eos = refs[0][0, len(prompts[0]) + 9].item()
    runs, calls, prefills = [], [], []
    start, extend, prefill = Call.start, TreeDrafter.extend, TreeDrafter.prefill

    def spy_start(self):
        runs.append(self)
        return start(self)

    def spy_extend(self, tokens):
        logits = extend(self, tokens)
        run = runs[-1]
        for row, prompt in enumerate(run.active):
            text = prompts[prompt] + run.out[prompt]
            assert tokens[row].tolist() == run.out[prompt][-tokens.shape[1]:]  # the none rounds' tokens, in order
            fresh, _ = drafter.prefill(torch.tensor([text]))
            torch.testing.assert_close(logits[row], fresh[0], rtol=1e-4, atol=1e-4)
        calls.append(tokens.shape[1])
        return logits

    def spy_prefill(self, ids, mask):
        run = runs[-1]
        prefills.append((run.stats.rounds, [mask[row].sum().item() for row in range(len(run.active))]))
        return prefill(self, ids, mask)

    monkeypatch.setattr(TreeDrafter, "prefill", spy_prefill)
    monkeypatch.setattr(Call, "start", spy_start)
    monkeypatch.setattr(TreeDrafter, "extend", spy_extend)
    policy = Scripted()
    result = generate(target, drafter, prompts, max_new_tokens=NEW, tree=policy, eos_token_id=eos)
    assert result.new_tokens == [hf_greedy(target, torch.tensor([p]), NEW, eos_token_id=eos)[0, len(p):].tolist()
                                 for p in prompts]
    assert len({row.stats.rounds for row in result.rows}) > 1  # rows left the batch while tokens were pending
    arms = [ARMS[a] for a in policy.pulled]
    expected, behind = [], 0
    for arm in arms:
        if arm != "none" and behind:
            expected.append(behind)
        behind = behind + 1 if arm == "none" else 0
    assert calls == expected and max(calls) > 1
    assert prefills == [(arms.index("1,1"), [len(p) for p in prompts])]  # once, at the first drafted round


def test_autoregressive_batch_is_the_targets_greedy(greedy_setup):
    target, _, prompts, refs = greedy_setup
    result = generate_autoregressive(target, prompts, max_new_tokens=NEW)
    assert all(torch.equal(row.tokens, ref) for row, ref in zip(result.rows, refs))
    assert result.stats.rounds == NEW and result.stats.target_forwards == NEW + 1  # prefill + NEW decodes
    assert result.mean_accepted == [1.0] * len(prompts)
    eos = refs[2][0, len(prompts[2]) + 5].item()
    ended = generate_autoregressive(target, prompts, max_new_tokens=NEW, eos_token_id=eos)
    assert ended.new_tokens == [hf_greedy(target, torch.tensor([p]), NEW, eos_token_id=eos)[0, len(p):].tolist()
                                for p in prompts]


@pytest.fixture(scope="module")
def float64_setup(tmp_path_factory):
    """Float64 models: batched and single forwards then agree far below any sampling decision's resolution."""
    target = tiny_llama(seed=5).to(torch.float64)
    drafter = aligned_drafter(tmp_path_factory.mktemp("f64"), target).to(torch.float64)
    return target, drafter


class RoundRobin(UCBBandit):
    """Arms in turn, whatever the rewards: a batch and a single run then pull the same arm every round."""

    def select(self) -> int:
        return self.rounds % len(self.arms)


@pytest.mark.parametrize("tree", ["3,2,1", "none", "round-robin", "ar"])
def test_sampled_rows_reproduce_single_runs_with_their_seed(float64_setup, tree):
    """Row b draws from its own generator (seed + b) exactly as the single-prompt call with that seed does, so it
    samples the same drafts from the same q: "round-robin" alternates none and drafted rounds, which checks that the
    drafter stays in sync through no-speculation rounds (a stale drafter state would draft other tokens)."""
    target, drafter = float64_setup
    prompts = [[4, 9, 1], [33], [8, 2, 60, 17, 5, 5]]
    kwargs = dict(max_new_tokens=25, temperature=0.8, top_k=20)
    if tree == "round-robin":
        tree = RoundRobin(arms=("none", "none", "1,1", "3,2,1"))
    if tree == "ar":
        result = generate_autoregressive(target, prompts, seed=7, **kwargs)
        singles = [generate_autoregressive(target, torch.tensor([p]), seed=7 + b, **kwargs)
                   for b, p in enumerate(prompts)]
    else:
        result = generate(target, drafter, prompts, seed=7, tree=tree, **kwargs)
        singles = [generate(target, drafter, torch.tensor([p]), seed=7 + b, tree=tree, **kwargs)
                   for b, p in enumerate(prompts)]
    for row, single in zip(result.rows, singles):
        assert torch.equal(row.tokens, single.tokens)
        assert row.stats.accepted_lengths == single.stats.accepted_lengths
    assert len({tuple(row.new_tokens[0].tolist()) for row in result.rows}) == len(prompts)


@pytest.mark.parametrize("verifier, params", [("topk", {"k": 3}), ("fly", {"theta": 0.0, "window": 1})])
def test_lossy_verifiers_decide_each_row_as_alone(float64_setup, verifier, params):
    """Lossy rules judge each row on its own tokens and logits: rows equal single runs, lossy accepts included."""
    target, drafter = float64_setup
    prompts = [[4, 9, 1], [33], [8, 2, 60, 17, 5, 5]]
    kwargs = dict(max_new_tokens=30, tree="3,2,1", verifier=verifier, verifier_params=params)
    result = generate(target, drafter, prompts, **kwargs)
    singles = [generate(target, drafter, torch.tensor([p]), **kwargs) for p in prompts]
    for row, single in zip(result.rows, singles):
        assert torch.equal(row.tokens, single.tokens)
        assert row.stats.lossy_accepts == single.stats.lossy_accepts
    assert result.stats.lossy_accepts == sum(s.stats.lossy_accepts for s in singles) > 0


class HeadCheck(GreedyVerifier):
    """Greedy, after checking that the row's hidden states are its own: the target's head maps them to its logits
    (what DropMatch and AutoJudge rely on)."""

    needs_hidden = True
    checked = 0

    def verify(self, inp):
        torch.testing.assert_close(inp.lm_head(inp.hidden), inp.target_logits)
        self.checked += 1
        return super().verify(inp)


def test_verifiers_needing_hidden_states_get_each_rows_own(greedy_setup):
    target, drafter, prompts, refs = greedy_setup
    verifier = HeadCheck()
    result = generate(target, drafter, prompts, max_new_tokens=NEW, tree="3,2,1", verifier=verifier)
    assert all(torch.equal(row.tokens, ref) for row, ref in zip(result.rows, refs))
    assert verifier.checked == sum(row.stats.rounds for row in result.rows)


@pytest.mark.parametrize("kind", ["mamba", "transformer"])
def test_first_two_tokens_law_of_every_row(tmp_path, monkeypatch, kind):
    """Lossless sampling per row: each row's first two tokens jointly follow the target's processed distribution for
    its prompt (the second token comes from an accepted level-2 draft, a correction or the bonus). 2,000 rows per
    prompt in one batch (seeds 0..5,999); the TV bound is tests/helpers/sampling_law.py's, over the 64 pairs.
    Either drafter kind: a Mamba drafter, or a Transformer drafter (its KV rows kept small: 12,000 rows of them)."""
    vocab = 8
    target = tiny_llama(vocab=vocab, hidden=16, layers=1, seed=11, head_scale=3.0)
    if kind == "mamba":
        drafter = random_drafter(tmp_path, vocab=vocab, hidden=16, layers=1, seed=12, head_scale=3.0)
    else:
        monkeypatch.setattr(transformer_module, "INITIAL_SLOTS", 8)
        drafter = TransformerDrafter(tiny_llama(vocab=vocab, hidden=16, layers=1, seed=12, head_scale=3.0))
    prompts, runs = ([3], [5, 1, 6], [2, 7, 0, 4, 4]), 2000
    params = SamplingParams(0.9, top_k=6)
    batch = [p for p in prompts for _ in range(runs)]  # grouped by prompt: the drafter prefills equal lengths at once
    result = generate(target, drafter, batch, max_new_tokens=2, tree="3,2", temperature=0.9, top_k=6, seed=0)
    pairs = torch.tensor([tokens[0] * vocab + tokens[1] for tokens in result.new_tokens]).view(len(prompts), runs)
    accepted = sum(row.stats.cut_tokens > 0 for row in result.rows) / len(batch)
    assert 0.05 < accepted < 0.95  # both branches of the rule ran: accepted drafts and rejections
    for prompt, drawn in zip(prompts, pairs):
        law = torch.bincount(drawn, minlength=vocab * vocab).double().view(vocab, vocab) / runs
        assert_follows(law, exact_first_two(target, prompt, params), runs)


def test_bad_batches_are_refused_before_any_model_runs(greedy_setup, monkeypatch):
    target, drafter, prompts, _ = greedy_setup

    def boom(*args, **kwargs):
        raise AssertionError("a model ran")

    monkeypatch.setattr(target, "forward", boom)
    for name in ("prefill", "step", "extend", "forward"):
        monkeypatch.setattr(drafter, name, boom)
    ids, mask = left_padded(prompts)
    right = mask.flip(1)
    huge = torch.zeros(2**20, 1, dtype=torch.long)  # 2^20 trees of 585 nodes: terabytes of drafter state
    cases = [
        (dict(input_ids=ids, attention_mask=right), "prompt 0 is not left-padded"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), "attention_mask has shape"),
        (dict(input_ids=ids, attention_mask=torch.cat([mask[:1] * 0, mask[1:]])), "prompt 0 is empty"),
        (dict(input_ids=[[1, 2], [], [3]]), "prompt 1 is empty"),
        (dict(input_ids=[]), "non-empty list"),
        (dict(input_ids=prompts, attention_mask=mask), "a list of prompts is padded here"),
        (dict(input_ids=[[1, 2], [VOCAB]]), r"must lie in \[0, 64\)"),
        (dict(input_ids=huge, tree="8,8,8"), "drafter state rows"),
        (dict(input_ids=prompts, max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(input_ids=prompts, seed=1.5), "seed must be an integer"),
    ]
    for kwargs, message in cases:
        kwargs = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message) as err:
            generate(target, drafter, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not left-padded"):
        generate_autoregressive(target, ids, attention_mask=right, max_new_tokens=4)


def test_generate_and_generate_autoregressive_take_a_batch(greedy_setup):
    """The public entry points dispatch a list of prompts, or left-padded ids + mask, to the batched loops."""
    target, drafter, prompts, refs = greedy_setup
    spec = generate(target, drafter, prompts, max_new_tokens=NEW, tree="1,1")
    ids, mask = left_padded(prompts)
    plain = generate_autoregressive(target, ids, attention_mask=mask, max_new_tokens=NEW)
    for result in (spec, plain):
        assert all(torch.equal(row.tokens, ref) for row, ref in zip(result.rows, refs))
    with pytest.raises(ValueError, match="no streamer"):
        generate(target, drafter, prompts, max_new_tokens=NEW, streamer=object())
    one = generate(target, drafter, torch.tensor([prompts[0]]), max_new_tokens=NEW, tree="1,1")
    assert torch.equal(one.tokens, refs[0])  # (1, L) without a mask stays the single-prompt path


def test_on_tokens_sees_every_rows_commits_and_stops_a_row_it_refuses(greedy_setup):
    """`on_tokens(row, tokens, logprobs)` gets each row's committed tokens (and, asked for, their log-probabilities)
    every round; False ends that row there (a server's client gone, a stop string), the other rows decode on as
    alone."""
    target, drafter, prompts, refs = greedy_setup
    seen: dict[int, list[int]] = {}
    seen_logprobs: dict[int, list] = {}

    def on_tokens(row, tokens, logprobs):
        seen.setdefault(row, []).extend(tokens)
        seen_logprobs.setdefault(row, []).extend(logprobs)
        return not (row == 1 and len(seen[row]) >= 5)

    result = generate(target, drafter, prompts, max_new_tokens=NEW, tree="2,1", on_tokens=on_tokens, logprobs=1)
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        assert seen[b] == result.new_tokens[b] == [t.token for t in seen_logprobs[b]]
        assert seen_logprobs[b] == result.rows[b].logprobs
        if b != 1:
            assert result.new_tokens[b] == ref[0, len(p):].tolist()
    assert 5 <= len(result.new_tokens[1]) < NEW and result.new_tokens[1] == refs[1][0, len(prompts[1]):].tolist()[
        : len(result.new_tokens[1])]


def test_a_seed_per_row_gives_each_row_what_that_seed_gives_alone(greedy_setup):
    target, drafter, prompts, _ = greedy_setup
    seeds = [11, 3, 29]
    batch = generate(target, drafter, prompts[:3], max_new_tokens=16, tree="2,1", temperature=1.0, seed=seeds)
    for p, s, row in zip(prompts, seeds, batch.new_tokens):
        alone = generate(target, drafter, torch.tensor([p]), max_new_tokens=16, tree="2,1", temperature=1.0, seed=s)
        assert alone.new_tokens[0].tolist() == row
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generate(target, drafter, prompts[:3], max_new_tokens=4, tree="2,1", temperature=1.0, seed=[1, 2])
