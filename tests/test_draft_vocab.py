"""Draft vocabularies (EAGLE-3's d2t, FR-Spec) in tree_search: a drafter that proposes only a subset of the
target's ids drafts inside that subset and stays lossless; a drafter narrower than the target no longer crashes.

Sampling bound: tests/helpers/sampling_law.py's, over the K = 64 first-two-token outcomes (an exact sampler fails
it with probability < 1e-6). N = 2,000 runs per case (bound ≈ 0.14, in batches of 500 rows); deliberately broken
variants, measured with this setup and N while writing the test, fail it by a wide margin: q written into columns
0..k-1 instead of its target ids gave TV 0.62 (subset) / 0.65 (narrow), q scattered in sorted-id order instead of
the map's order gave 0.66 / 0.63 (exact sampling: 0.064 / 0.064).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mamba_draft import MambaDrafter
from mamba_draft.checkpoint import DRAFT_VOCAB
from mamba_draft.convert import convert
from mamba_draft.tree import TreeConfig
from tests.helpers.sampling_law import assert_follows, empirical, exact_first_two, seeded_runs
from tests.helpers.tree_models import (
    SizedTokenizer, aligned_drafter, draft_subset, hf_greedy, prompts, random_drafter, tiny_llama,
)
from tree_search.tree_drafter import TreeDrafter
from tree_search.generate import generate
from tree_search.sampling import SamplingParams

VOCAB, NEW_TOKENS = 64, 60


@pytest.fixture
def drafted(monkeypatch):
    """Spy on TreeDrafter: every drafted token and, per round, the recorded q of the nodes that had children."""
    seen = {"tokens": [], "probs": []}
    draft, draft_lookup = TreeDrafter.draft, TreeDrafter.draft_chain_lookup

    def note(buf):  # a batch's trees (B, T+1) or one prompt's lookup chain (T+1,): every row's the same way
        tokens, probs = buf.tokens.view(-1, len(buf.tree)), buf.probs.view(-1, len(buf.tree), buf.probs.shape[-1])
        seen["tokens"] += tokens[:, 1:].flatten().tolist()
        seen["probs"] += list(probs[:, : buf.tree.levels[-1][0]].clone())
        return buf

    monkeypatch.setattr(TreeDrafter, "draft", lambda self, *a, **k: note(draft(self, *a, **k)))
    monkeypatch.setattr(TreeDrafter, "draft_chain_lookup",
                        lambda self, *a, **k: (lambda out: (note(out[0]), out[1]))(draft_lookup(self, *a, **k)))
    return seen


def check_drafts(seen, ids: torch.Tensor, recorded: bool) -> None:
    """Drafted tokens lie inside the draft vocabulary; recorded q is a distribution with no mass outside it."""
    assert seen["tokens"] and set(seen["tokens"]) <= set(ids.tolist())
    if recorded:
        outside = torch.ones(seen["probs"][0].shape[-1], dtype=torch.bool)
        outside[ids] = False
        for probs in seen["probs"]:
            assert torch.all(probs[:, outside] == 0)
            torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]))


# ---------------------------------------------------------------- greedy: token-identical to the target


@pytest.fixture(scope="module")
def subset_setup(tmp_path_factory):
    """Llama target + aligned drafter restricted to 16 of 64 ids: 8 its greedy outputs use most, 8 they never use."""
    target = tiny_llama(vocab=VOCAB)
    drafter = aligned_drafter(tmp_path_factory.mktemp("aligned"), target)  # shrinks the target: references after
    ps = prompts(VOCAB, 5, seed=21, min_len=2)
    refs = [hf_greedy(target, p, NEW_TOKENS) for p in ps]
    used = torch.cat([r[0, p.shape[1]:] for p, r in zip(ps, refs)])
    ids = draft_subset(VOCAB, VOCAB // 4, used.tolist())
    drafter.set_draft_vocab(ids)
    assert drafter.vocab_size == 16 and 0 < torch.isin(used, ids).float().mean() < 1
    return target, drafter, ps, refs, ids


@pytest.mark.parametrize("tree, lookup", [("1,1,1,1,1", False), ("3,2,2,1,1", False), ("bandit", False),
                                          ("1,1,1,1,1", True)], ids=["chain", "tree", "bandit", "chain-lookup"])
def test_greedy_is_token_identical_with_a_draft_vocabulary(subset_setup, drafted, tree, lookup):
    target, drafter, ps, refs, ids = subset_setup
    taus = []
    for prompt, ref in zip(ps, refs):
        result = generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, tree=tree, temperature=0.0,
                          verifier="greedy", prompt_lookup=lookup)
        assert torch.equal(result.tokens, ref), f"prompt {prompt.tolist()} diverged"
        taus.append(result.stats.mean_accepted)
    check_drafts(drafted, ids, recorded=False)
    # drafts are mapped to the right target ids: the subset drafter still gets accepted well beyond chance
    assert sum(taus) / len(taus) > 2.0  # (1.0 when columns are taken for ids)


def test_lookup_chain_equals_the_stepped_chain(subset_setup):
    """Prompt lookup compares its proposals (target ids) with the drafter's mapped greedy tokens: same chain, same q."""
    _, drafter, _, refs, ids = subset_setup
    config = TreeConfig((1,) * 8)
    drafts = TreeDrafter(drafter, config.num_nodes + 1, VOCAB)
    accepted = 0
    for ref in refs:
        context = ref[0]
        logits = drafts.prefill(ref)
        buf, lookup = drafts.draft_chain_lookup(config, drafts.roots[:1], logits, context, record_probs=True)
        tokens, probs = buf.tokens.clone(), buf.probs.clone()
        accepted += lookup.accepted
        buf = drafts.draft(config, drafts.roots[:1], logits, SamplingParams(0.0), "topk", True, None)
        assert torch.equal(tokens, buf.tokens)
        torch.testing.assert_close(probs, buf.probs, atol=1e-5, rtol=1e-4)
        assert set(tokens[0, 1:].tolist()) <= set(ids.tolist())
    assert accepted > 0  # some proposals matched the drafter's mapped greedy tokens


# ---------------------------------------------------------------- sampling: exact law


SAMPLE_VOCAB, RUNS, PROMPT = 8, 2_000, [3]


@pytest.fixture(scope="module")
def sample_models(tmp_path_factory):
    """vocab-8 Llama target; drafters (sharp heads, unrelated to the target) over 3 of its ids: a full-width one and
    a narrow one that reads only ids < 6 (its tokenizer's), so the target often samples ids 6, 7 it cannot read."""
    target = tiny_llama(vocab=SAMPLE_VOCAB, hidden=16, layers=1, seed=11, head_scale=3.0)
    full = random_drafter(tmp_path_factory.mktemp("full"), vocab=8, hidden=16, layers=1, seed=12, head_scale=3.0)
    narrow = random_drafter(tmp_path_factory.mktemp("narrow"), vocab=6, hidden=16, layers=1, seed=12, head_scale=3.0)
    full.set_draft_vocab(torch.tensor([6, 1, 4]))  # the target's likeliest first token (6) and two others
    narrow.set_draft_vocab(torch.tensor([5, 2, 0]))
    return target, {"subset": (full, None), "narrow-subset": (narrow, SizedTokenizer(6))}


@pytest.mark.parametrize("case", ["subset", "narrow-subset"])
def test_first_two_tokens_follow_the_target_distribution(sample_models, drafted, case):
    target, drafters = sample_models
    drafter, tokenizer = drafters[case]
    read, rejected_first = [], []
    hook = drafter.backbone.embeddings.register_forward_pre_hook(lambda _, args: read.append(int(args[0].max())))

    def run(seed, rows):
        result = generate(target, drafter, [PROMPT] * rows, max_new_tokens=2, tree="2,1", temperature=1.0, top_k=0,
                          top_p=1.0, verifier="sampling", verifier_params={"keyed": False}, seed=seed,
                          tokenizer=tokenizer)
        rejected_first.extend(row.stats.accepted_lengths[0] == 1 for row in result.rows)
        return result.new_tokens

    try:
        outcomes = seeded_runs(run, RUNS, 500)
    finally:
        hook.remove()
    law = empirical([tuple(t) for t in outcomes], (SAMPLE_VOCAB, SAMPLE_VOCAB))
    assert_follows(law, exact_first_two(target, PROMPT, SamplingParams(1.0)), RUNS)
    assert 0.05 < sum(rejected_first) / RUNS < 0.95  # both branches of the rejection rule are exercised
    check_drafts(drafted, drafter.draft_ids, recorded=True)
    assert max(read) < drafter.input_vocab_size
    if case == "narrow-subset":  # often the first token was one the drafter cannot read, and it drafted on
        assert law[6:].sum() > 0.2


# ---------------------------------------------------------------- checkpoints keep the id map


def test_id_map_survives_save_convert_and_reload(tmp_path):
    drafter = random_drafter(tmp_path / "base", vocab=VOCAB)
    ids = torch.tensor([40, 3, 17, 63, 0, 22, 9, 51])
    drafter.set_draft_vocab(ids)
    drafter.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "ssm", to="mamba_ssm")
    convert(tmp_path / "ssm", tmp_path / "hf2", to="hf")
    prompt = torch.tensor([[5, 60, 12, 33]])
    expected = drafter(prompt)
    assert expected.shape[-1] == ids.numel()
    for name in ("hf", "ssm", "hf2"):
        assert torch.equal(load_file(str(tmp_path / name / DRAFT_VOCAB))["d2t"], ids)
        loaded = MambaDrafter.from_pretrained(str(tmp_path / name))
        assert torch.equal(loaded.draft_ids, ids)
        assert torch.equal(loaded(prompt), expected)
        state = loaded.allocate_state(1)
        loaded.prefill(prompt, state=state)
        reference = drafter.allocate_state(1)
        drafter.prefill(prompt, state=reference)
        token = torch.tensor([61])
        assert torch.equal(loaded.step(token, state), drafter.step(token, reference))


# ---------------------------------------------------------------- a drafter narrower than the target


@pytest.fixture(scope="module")
def narrow_pair(tmp_path_factory):
    """Random vocab-64 target; drafter with 48 ids, the tokenizer's real vocabulary (ids 48..63 are padding the
    random target still samples, and even picks greedily)."""
    target = tiny_llama(vocab=VOCAB, seed=3)
    return target, random_drafter(tmp_path_factory.mktemp("narrow"), vocab=48)


@pytest.mark.parametrize("subset", [False, True], ids=["full-vocab", "subset"])
def test_padding_ids_the_drafter_cannot_read_are_clamped(narrow_pair, drafted, subset):
    """Used to crash (IndexError in the drafter's embedding) once the target committed an id >= 48. Choice: the
    drafter reads such ids as its last readable id (47); the target verifies the real tokens, so output stays exact."""
    target, drafter = narrow_pair
    ids = draft_subset(48, 12, list(range(0, 48, 2))) if subset else None
    drafter.set_draft_vocab(ids)
    read = []
    hook = drafter.backbone.embeddings.register_forward_pre_hook(lambda _, args: read.append(int(args[0].max())))
    tokenizer = SizedTokenizer(48)
    try:
        committed = []
        for seed in range(4):  # sampling at temperature 1, tree (3, 2): the case that crashed
            result = generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=30, tree="3,2",
                              temperature=1.0, top_k=0, top_p=1.0, verifier="sampling", seed=seed,
                              tokenizer=tokenizer)
            committed += result.new_tokens[0].tolist()
        assert max(committed) >= 48
        prompt = torch.tensor([[50, 7, 63, 20]])  # padding ids in the prompt too
        reference = hf_greedy(target, prompt, 40)
        assert int(reference[0, 4:].max()) >= 48  # the target's own greedy output uses padding ids
        for tree, lookup in (("3,2,1", False), ("1,1,1,1", True)):
            result = generate(target, drafter, prompt, max_new_tokens=40, tree=tree, temperature=0.0,
                              verifier="greedy", tokenizer=tokenizer, prompt_lookup=lookup)
            assert torch.equal(result.tokens, reference)
    finally:
        hook.remove()
        drafter.set_draft_vocab(None)
    assert max(read) < 48
    assert set(drafted["tokens"]) <= set((ids if subset else torch.arange(48)).tolist())

    drafts = TreeDrafter(drafter, 8, VOCAB)
    assert drafts.read_limit == 47
    logits = drafts.prefill(torch.tensor([[1, 2]]))
    buf = drafts.draft(TreeConfig((1,)), drafts.roots[:1], logits, SamplingParams(0.0), "topk", False, None)
    after = drafts.resync(buf, [0], [60])  # a padding id past the drafter's embedding: it reads id 47 instead
    assert drafts.roots[0].item() == 60  # the root stays the real token
    torch.testing.assert_close(after[0], drafter.forward(torch.tensor([[1, 2, 47]]))[0, -1], atol=1e-4, rtol=1e-4)


def test_a_drafter_that_reads_the_whole_vocabulary_keeps_the_fast_path(subset_setup):
    _, drafter, _, _, _ = subset_setup
    drafts = TreeDrafter(drafter, 4, VOCAB)
    assert drafts.read_limit is None


# ---------------------------------------------------------------- bad maps: one clear line, before any work


@pytest.fixture
def counted(monkeypatch):
    """A vocab-64 target plus counters on every target forward and every drafter prefill/step."""
    target = tiny_llama(vocab=VOCAB)
    calls = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append("target"))
    monkeypatch.setattr(MambaDrafter, "prefill", lambda *a, **k: calls.append("drafter"))
    monkeypatch.setattr(MambaDrafter, "step", lambda *a, **k: calls.append("drafter"))
    yield target, calls
    handle.remove()


@pytest.mark.parametrize(
    "drafter_vocab, ids, assign, kwargs, message",
    [
        (72, [3, 70, 5], False, {},
         r"draft vocabulary ids must lie in the target's vocabulary \[0, 64\), got \[3, 70\]"),
        (64, [3, 9, 3], True, {}, "draft vocabulary ids must be distinct"),
        (48, [3, 9, 5], False, {}, "the drafter reads 48 token ids but target LlamaForCausalLM has 64"),
        (48, [3, 9, 5], False, {"tokenizer": SizedTokenizer(56)}, "the drafter reads 48 token ids but the tokenizer "
                                                                     "has 56"),
        (64, [3, 9], False, {"tree": "3,1"}, "asks for 3 distinct children but the vocabulary has 2 tokens"),
    ],
    ids=["id-beyond-target", "duplicates", "reads-too-few", "reads-less-than-tokenizer", "tree-wider-than-subset"],
)
def test_bad_draft_vocabulary_is_refused_before_any_work(tmp_path, counted, drafter_vocab, ids, assign, kwargs,
                                                          message):
    target, calls = counted
    drafter = random_drafter(tmp_path / "d", vocab=drafter_vocab)
    if assign:  # set_draft_vocab refuses duplicates itself; a map assigned directly is caught by generate
        drafter.draft_ids = torch.tensor(ids)
    else:
        drafter.set_draft_vocab(torch.tensor(ids))
    with pytest.raises(ValueError, match=message) as err:
        generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=5,
                 **{"tree": "2,1", "temperature": 0.0, "verifier": "greedy", **kwargs})
    assert "\n" not in str(err.value)
    assert calls == []


def test_bad_maps_are_refused_by_the_drafter_and_its_checkpoints(tmp_path):
    drafter = random_drafter(tmp_path / "base", vocab=VOCAB)
    with pytest.raises(ValueError, match="draft vocabulary ids must be distinct"):
        drafter.set_draft_vocab(torch.tensor([4, 8, 4]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 64\)"):
        drafter.set_draft_vocab(torch.tensor([4, 64]))
    drafter.set_draft_vocab(torch.tensor([4, 8, 15]))
    drafter.save_pretrained(tmp_path / "saved")
    save_file({"d2t": torch.tensor([4, 8, 4])}, str(tmp_path / "saved" / DRAFT_VOCAB))
    with pytest.raises(ValueError, match="distinct"):
        MambaDrafter.from_pretrained(str(tmp_path / "saved"))
