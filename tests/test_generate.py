"""generate(): greedy output is token-identical to the target's own greedy `generate`; compaction, stops, errors."""
import pytest
import torch

from mamba_draft.targets.cache import TargetCache
from tests.helpers.tree_models import (
    aligned_drafter, encoded_cache, hf_greedy, prompts, random_drafter, tiny_causal_lm, tiny_llama, tiny_neox,
)
from mamba_draft.tree import TreeConfig
from tree_search import UCBBandit
from tree_search.generate import generate, generate_autoregressive

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)

TREES = ["1,1,1,1,1", "3,2,2,1,1", "3,3,2,1", "2,2,2,1,1,1", "4", "bandit"]
NEW_TOKENS = 100


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """(target, drafter, prompts, HF greedy references) for: Llama + aligned drafter, GPT-NeoX + aligned drafter,
    Llama + an unrelated random drafter (acceptance by chance only)."""
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for name, make in (("llama", tiny_llama), ("neox", tiny_neox)):
        target = make()
        drafter = aligned_drafter(root / name, target)
        out[name] = (target, drafter)
    random_target = tiny_llama(seed=3)
    out["llama-random-drafter"] = (random_target, random_drafter(root / "random", vocab=64))
    cases = {}
    for name, (target, drafter) in out.items():
        ps = prompts(64, 4 if "random" in name else 10, seed=len(name))  # random drafter: ~1 token/round, slow
        cases[name] = (target, drafter, ps, [hf_greedy(target, p, NEW_TOKENS) for p in ps])
    return cases


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("case", ["llama", "neox", "llama-random-drafter"])
def test_greedy_is_token_identical_to_target_generate(setups, case, tree):
    target, drafter, ps, refs = setups[case]
    taus = []
    for prompt, ref in zip(ps, refs):
        result = generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, tree=tree)
        assert torch.equal(result.tokens, ref), f"prompt {prompt.tolist()} diverged"
        assert result.stats.new_tokens == NEW_TOKENS
        assert sum(result.stats.accepted_lengths) == NEW_TOKENS
        assert result.stats.target_forwards == result.stats.rounds + (prompt.shape[1] > 1)
        taus.append(result.stats.mean_accepted)
    if case != "llama-random-drafter":
        assert sum(taus) / len(taus) > 1.5  # the aligned drafter makes acceptance non-trivial


def test_eos_inside_an_accepted_path(setups):
    target, drafter, ps, refs = setups["llama"]
    cut_inside_path = 0
    for prompt, ref in zip(ps, refs):
        eos = int(ref[0, prompt.shape[1] + 30])  # a token the target really emits mid-way
        expected = hf_greedy(target, prompt, NEW_TOKENS, eos_token_id=eos)
        assert int(expected[0, -1]) == eos and expected.shape[1] <= prompt.shape[1] + 31
        result = generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, tree="3,2,2,1,1", eos_token_id=eos)
        assert torch.equal(result.tokens, expected)
        cut_inside_path += result.stats.cut_tokens > 0
    assert cut_inside_path > 0  # at least one EOS landed before the end of an accepted path


def test_eos_from_the_generation_config(setups):
    target, drafter, ps, refs = setups["neox"]
    prompt, ref = ps[0], refs[0]
    eos = int(ref[0, prompt.shape[1] + 10])
    target.generation_config.eos_token_id = eos
    try:
        expected = hf_greedy(target, prompt, NEW_TOKENS, eos_token_id=eos)
        assert torch.equal(generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, tree="2,2,1").tokens, expected)
    finally:
        target.generation_config.eos_token_id = None


def test_eos_token_id_as_a_tensor_or_numpy_integer(setups):
    """transformers takes eos_token_id as an int, a list, a tensor or a numpy integer: so does generate; a float or
    a string is refused in one line before anything runs."""
    import numpy as np

    target, drafter, ps, refs = setups["llama"]
    prompt, ref = ps[1], refs[1]
    eos = int(ref[0, prompt.shape[1] + 12])
    expected = hf_greedy(target, prompt, NEW_TOKENS, eos_token_id=eos)
    for given in (torch.tensor(eos), np.int64(eos), torch.tensor([eos, 10**6]), np.array([eos]), [torch.tensor(eos)]):
        assert torch.equal(generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, tree="2,1",
                                    eos_token_id=given).tokens, expected), given
        assert torch.equal(generate_autoregressive(target, prompt, max_new_tokens=NEW_TOKENS,
                                                   eos_token_id=given).tokens, expected), given
    for bad, message in ((torch.tensor([1.0]), "must hold integer token ids, got an array of float32"),
                         ("2", "must be a token id .*, got .2."), (True, "must be a token id .*, got True")):
        with pytest.raises(ValueError, match=f"^eos_token_id {message}") as err:
            generate(target, drafter, prompt, max_new_tokens=4, eos_token_id=bad)
        assert "\n" not in str(err.value)


def test_a_seeded_sampled_reply_is_the_same_alone_in_a_batch_under_any_tree_and_plainly(setups):
    """Seeded lossless sampling draws by (seed, position): a prompt with seed s samples the same tokens alone, as
    row b of a batch seeded s - b, under any tree shape or policy, and with speculation off."""
    target, drafter, ps, _ = setups["llama"]
    options = {"max_new_tokens": 40, "temperature": 0.8, "top_k": 0}
    for p in ps[:4]:
        plain = generate_autoregressive(target, p, seed=7, **options).tokens
        for tree in ("3,2,2,1,1", "1,1,1,1,1", "4", "auto", "bandit"):
            assert torch.equal(generate(target, drafter, p, tree=tree, seed=7, **options).tokens, plain), tree
    batch = generate(target, drafter, [p[0].tolist() for p in ps[:4]], tree="3,2,2,1,1", seed=[7, 7, 7, 7], **options)
    assert [row.tokens[0].tolist() for row in batch.rows] == [
        generate_autoregressive(target, p, seed=7, **options).tokens[0].tolist() for p in ps[:4]]
    assert any(not torch.equal(generate(target, drafter, p, seed=8, **options).tokens,
                               generate(target, drafter, p, seed=7, **options).tokens) for p in ps[:4])  # a draw


@pytest.mark.parametrize("tree", ["3,2,2,1,1", "bandit"])
def test_logprobs_are_the_targets_own_at_every_committed_token(setups, tree):
    """logprobs=k: every new token's log-probability under the target's own forward over the sequence (within float
    rounding: verification forwards are not the plain forward's shape), its top-k alternatives best first (the
    first is the token itself under greedy), alone and in a batch; none unless asked."""
    target, drafter, ps, refs = setups["llama"]
    batch = generate(target, drafter, [p[0].tolist() for p in ps[:3]], max_new_tokens=30, tree=tree, logprobs=4)
    for p, row in zip(ps, batch.rows):
        alone = generate(target, drafter, p, max_new_tokens=30, tree=tree, logprobs=4)
        with torch.no_grad():
            logits = target(alone.tokens).logits[0, p.shape[1] - 1:-1].float()
        expected = torch.log_softmax(logits, -1)
        new = alone.tokens[0, p.shape[1]:]
        for result in (alone, row):
            assert [t.token for t in result.logprobs] == new.tolist()
            got = torch.tensor([t.logprob for t in result.logprobs])
            assert torch.allclose(got, expected.gather(1, new[:, None])[:, 0], atol=1e-5)
            assert all(len(t.top) == 4 and t.top[0][0] == t.token and t.top[0][1] == t.logprob for t in result.logprobs)
    assert generate(target, drafter, ps[0], max_new_tokens=5).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be a number of top alternatives >= 0"):
        generate(target, drafter, ps[0], max_new_tokens=5, logprobs=-1)


def test_max_new_tokens_inside_an_accepted_path(setups):
    target, drafter, ps, refs = setups["neox"]
    cut_inside_path = 0
    for max_new in range(1, 13):
        for prompt, ref in zip(ps[:3], refs[:3]):
            result = generate(target, drafter, prompt, max_new_tokens=max_new, tree="1,1,1,1,1")
            assert torch.equal(result.tokens, ref[:, : prompt.shape[1] + max_new])
            cut_inside_path += result.stats.cut_tokens > 0
    assert cut_inside_path > 0


@pytest.mark.parametrize("temperature, verifier", [(0.0, "greedy"), (1.0, "sampling")])
def test_cache_is_compacted_every_round(setups, monkeypatch, temperature, verifier):
    """After every round the target cache equals the cache from re-encoding the committed sequence."""
    target, drafter, ps, _ = setups["llama"]
    original_commit = TargetCache.commit
    snapshots = []  # (path length, cache length, keys and values of every layer) after each commit

    def recording_commit(self, paths):
        original_commit(self, paths)
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]
        snapshots.append((len(paths[0]), self.slots, layers))

    monkeypatch.setattr(TargetCache, "commit", recording_commit)
    result = generate(target, drafter, ps[1], max_new_tokens=40, tree="3,2,2,1,1", temperature=temperature,
                      verifier=verifier, seed=0)
    assert len(snapshots) == result.stats.rounds - 1 and max(s[0] for s in snapshots) >= 2
    assert result.tokens.shape[1] == ps[1].shape[1] + 40
    # the cache holds the committed sequence minus its root, i.e. a prefix of what generate returned
    for _, length, layers in snapshots:
        reference = encoded_cache(target, result.tokens[:, :length])
        for (keys, values), ref in zip(layers, reference.layers):  # a static cache: its first `length` slots
            torch.testing.assert_close(keys[:, :, :length], ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values[:, :, :length], ref.values, atol=1e-5, rtol=1e-4)


def test_autoregressive_baseline_matches_target_generate(setups):
    target, _, ps, refs = setups["llama"]
    for prompt, ref in zip(ps[:3], refs[:3]):
        result = generate_autoregressive(target, prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.tokens, ref)
        assert result.stats.mean_accepted == 1.0
        assert result.stats.target_forwards == NEW_TOKENS + 1  # the prefill, then the last prompt token and each token


def test_sampling_is_reproducible_with_a_seed(setups):
    target, drafter, ps, _ = setups["llama"]
    runs = [generate(target, drafter, ps[2], max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9,
                     verifier="sampling", tree="3,2,1", seed=s).tokens for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_persistent_bandit_keeps_statistics_across_calls(setups):
    target, drafter, ps, refs = setups["llama"]
    bandit = UCBBandit(persistent=True)
    first = generate(target, drafter, ps[0], max_new_tokens=30, tree=bandit)
    second = generate(target, drafter, ps[1], max_new_tokens=30, tree=bandit)
    assert torch.equal(second.tokens, refs[1][:, : ps[1].shape[1] + 30])
    assert bandit.rounds == first.stats.rounds + second.stats.rounds
    assert sum(a["pulls"] for a in second.stats.arms.values()) == bandit.rounds
    fresh = generate(target, drafter, ps[1], max_new_tokens=30, tree="bandit")
    assert sum(a["pulls"] for a in fresh.stats.arms.values()) == fresh.stats.rounds


def test_other_attention_families_are_lossless(tmp_path):
    for kind in ("mistral", "qwen2"):
        target = tiny_causal_lm(kind, sliding_window=256) if kind == "mistral" else tiny_causal_lm(kind)
        drafter = aligned_drafter(tmp_path / kind, target)
        for prompt in prompts(64, 3, seed=5):
            ref = hf_greedy(target, prompt, 40)
            assert torch.equal(generate(target, drafter, prompt, max_new_tokens=40, tree="3,2,2,1,1").tokens, ref)


# ---- bad input: a clear error, before any model runs ----


@pytest.mark.parametrize("case", ["llama", "llama-random-drafter"])
@pytest.mark.parametrize("tree", ["1,1", "3,2,1", "bandit", "none"])
def test_lookup_rounds_keep_greedy_identical(setups, case, tree):
    """lookup_tokens: rounds that verify prompt-lookup proposals (repetitive prompts make them fire) interleave with
    drafted and plain rounds; the output stays the target's own greedy output."""
    target, drafter, ps, _ = setups[case]
    lookups = 0
    for prompt in ps[:4]:
        repetitive = torch.cat([prompt, prompt, prompt[:, :3]], dim=1)  # its last n-grams recur
        ref = hf_greedy(target, repetitive, 40)
        result = generate(target, drafter, repetitive, max_new_tokens=40, tree=tree, lookup_tokens=6)
        assert torch.equal(result.tokens, ref), f"prompt {repetitive.tolist()} diverged"
        assert sum(result.stats.accepted_lengths) == 40 and result.stats.rounds == len(result.stats.accepted_lengths)
        lookups += result.stats.lookup_rounds
    assert lookups >= 4  # every prompt starts with a lookup round


def test_auto_is_the_cpu_default_bandit_with_lookup_rounds_for_one_prompt(setups, flat_verify_costs):
    """tree="auto" (the default) on a CPU: the planned measured-time bandit, with prompt-lookup rounds of <= 8
    tokens for one prompt, and the output stays the target's greedy output. A tree given, or a batch, runs no lookup
    rounds unless asked for."""
    target, drafter, ps, _ = setups["llama"]
    repetitive = torch.cat([ps[0], ps[0], ps[0][:, :3]], dim=1)
    ref = hf_greedy(target, repetitive, 40)
    auto = generate(target, drafter, repetitive, max_new_tokens=40)
    assert torch.equal(auto.tokens, ref)
    assert "none" in auto.stats.arms and len(auto.stats.arms) >= 4 and auto.stats.lookup_rounds >= 1
    given = generate(target, drafter, repetitive, max_new_tokens=40, tree="1,1")
    assert torch.equal(given.tokens, ref) and given.stats.lookup_rounds == 0
    batch = generate(target, drafter, [repetitive[0].tolist(), ps[1][0].tolist()], max_new_tokens=20)
    assert batch.rows[0].tokens.tolist() == hf_greedy(target, repetitive, 20).tolist()
    assert "none" in batch.stats.arms and len(batch.stats.arms) >= 4 and batch.stats.lookup_rounds == 0


@pytest.fixture
def counted(setups, monkeypatch):
    """The Llama setup with counters on every target forward and every drafter prefill/step."""
    target, drafter, _, _ = setups["llama"]
    calls = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append("target"))
    monkeypatch.setattr(type(drafter), "prefill", lambda *a, **k: calls.append("drafter"))
    monkeypatch.setattr(type(drafter), "step", lambda *a, **k: calls.append("drafter"))
    yield target, drafter, calls
    handle.remove()


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(tree="3,0"), ValueError, "positive"),
        (dict(tree=()), ValueError, "empty"),
        (dict(tree=3.5), TypeError, "tree must be"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "empty"),
        (dict(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])),
         ValueError, "left-padded"),  # a mask makes a batch, which refuses right padding first
        (dict(input_ids=torch.zeros(1, 600, dtype=torch.long)), ValueError, "max positions"),
        (dict(input_ids=torch.zeros(1, 500, dtype=torch.long)), ValueError, "max positions"),
        (dict(input_ids=torch.tensor([[1, 64]])), ValueError, r"\[0, 64\)"),
        (dict(input_ids=torch.tensor([[0.5, 1.0]])), TypeError, "integer"),
        (dict(verifier="no-such-verifier"), ValueError, "unknown verifier 'no-such-verifier'"),
        (dict(verifier="greedy", temperature=0.7), ValueError, "temperature 0"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(tree="100"), ValueError, "distinct children"),
        (dict(lookup_tokens=-1), ValueError, "lookup_tokens must be"),
        (dict(lookup_tokens=True), ValueError, "lookup_tokens must be"),
        (dict(lookup_tokens=4, prompt_lookup=True, tree="1,1"), ValueError, "pass one"),
        (dict(input_ids=[[1, 2], [3, 4]], lookup_tokens=4), ValueError, "one prompt"),
    ],
)
def test_bad_input_is_refused_before_any_work(counted, change, error, message):
    target, drafter, calls = counted
    kwargs = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=20, tree="3,2,1")
    kwargs.update(change)
    with pytest.raises(error, match=message):
        generate(target, drafter, **kwargs)
    assert calls == []


def test_vocab_mismatch_is_refused_before_any_work(tmp_path, counted):
    target, _, calls = counted
    small = random_drafter(tmp_path / "small", vocab=48)
    with pytest.raises(ValueError, match="vocabulary mismatch: drafter has 48 tokens, target LlamaForCausalLM has 64"):
        generate(target, small, torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    assert calls == []


def test_padded_vocabularies_are_accepted_with_a_tokenizer(tmp_path):
    """A drafter padded past the tokenizer (mamba pads to multiples of 8) is fine when the real vocabularies match."""
    target = tiny_llama(vocab=64)
    padded = random_drafter(tmp_path / "padded", vocab=72)

    class Tok:
        def __len__(self):
            return 60

    prompt = torch.tensor([[5, 6, 7]])
    result = generate(target, padded, prompt, max_new_tokens=20, tree="3,2", tokenizer=Tok())
    assert torch.equal(result.tokens, hf_greedy(target, prompt, 20))

    class BigTok:
        def __len__(self):
            return 70

    with pytest.raises(ValueError, match="tokenizer has 70 tokens"):
        generate(target, padded, prompt, max_new_tokens=20, tree="3,2", tokenizer=BigTok())


def test_sliding_window_overflow_is_refused(tmp_path):
    """A fixed shape that does not fit the window is refused in one line; so is a budget nothing fits."""
    target = tiny_causal_lm("mistral", sliding_window=64)
    drafter = random_drafter(tmp_path / "d", vocab=64)
    with pytest.raises(ValueError, match="sliding-window"):
        generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=40, tree="3,2,2,1,1")
    for tree in ("auto", "bandit"):
        with pytest.raises(ValueError, match="sliding-window"):
            generate(target, drafter, torch.tensor([[1, 2, 3]]), max_new_tokens=70, tree=tree)


@pytest.mark.parametrize("tree", ["auto", "bandit:3,3,2,1/2,1/1,1,1", "bandit-time:none/3,2,2,1,1/1,1"])
def test_a_policy_decodes_a_sliding_window_target_with_the_arms_that_fit(tmp_path, tree):
    """The default policy's widest arm (48 nodes), a bandit's 3,3,2,1 (48) or 3,2,2,1,1 (40) does not fit after a
    3-token prompt and 40 new tokens in a 63-token window: the call decodes with the arms that do, identical to the
    target's own greedy decoding, instead of being refused (the paper's bandit, none of whose arms fit, is)."""
    target = tiny_causal_lm("mistral", sliding_window=64)
    drafter = aligned_drafter(tmp_path / "d", target)
    for prompt in prompts(64, 4, seed=5, min_len=3, max_len=3):
        expected = hf_greedy(target, prompt, 40)
        result = generate(target, drafter, prompt, max_new_tokens=40, tree=tree)
        assert torch.equal(result.tokens, expected)
        pulled = [TreeConfig.parse(arm.strip("()")) for arm, stats in result.stats.arms.items()
                  if stats["pulls"] and arm != "lookup"]  # the shapes (lookup rounds: the lookup arm)
        assert pulled and all(arm.num_nodes <= 20 for arm in pulled)  # 3 + 40 + 20 = 63


def test_the_default_policy_fits_its_arms_to_the_targets_max_positions(tmp_path):
    """3 prompt tokens + 43 new leave a tree depth of 2 in 48 positions: `auto` drafts the shapes that fit."""
    target = tiny_causal_lm("qwen2", max_position_embeddings=48)
    drafter = aligned_drafter(tmp_path / "d", target)
    for prompt in prompts(64, 3, seed=7, min_len=3, max_len=3):
        result = generate(target, drafter, prompt, max_new_tokens=43)
        assert torch.equal(result.tokens, hf_greedy(target, prompt, 43))
        pulled = [TreeConfig.parse(arm.strip("()")) for arm, stats in result.stats.arms.items()
                  if stats["pulls"] and arm != "lookup"]  # the shapes (lookup rounds: the lookup arm)
        assert pulled and all(arm.depth <= 2 for arm in pulled)
    with pytest.raises(ValueError, match=r"tree depth \(3\) exceeds the target's 48 max positions"):
        generate(target, drafter, prompts(64, 1, seed=7, min_len=3, max_len=3)[0], max_new_tokens=43, tree="2,1,1")


def test_engine_options_and_call_options_are_split_from_one_set_of_keywords(setups):
    """`generate` takes the engine's options (`EngineOptions`, kept by a decoder) and the call's (`CallOptions`) as
    keywords: the same call through a kept decoder gives the same tokens; a misspelt option is a TypeError."""
    from tree_search.generate import ENGINE_OPTIONS, CallOptions, SpeculativeDecoder

    target, drafter, ps, _ = setups["llama"]
    assert set(ENGINE_OPTIONS) == {"tree", "verifier", "verifier_params", "prompt_lookup", "lookup_tokens",
                                   "integer_products"}
    assert not set(ENGINE_OPTIONS) & {f.name for f in __import__("dataclasses").fields(CallOptions)}
    once = generate(target, drafter, ps[0], tree="2,1", verifier="greedy", max_new_tokens=12, temperature=0)
    decoder = SpeculativeDecoder(target, drafter, tree="2,1", verifier="greedy")
    assert decoder.options.tree == "2,1" and decoder.options.verifier == "greedy"
    assert torch.equal(decoder.generate(ps[0], max_new_tokens=12, temperature=0).tokens, once.tokens)
    with pytest.raises(TypeError, match="trees"):
        generate(target, drafter, ps[0], trees="2,1", max_new_tokens=4)
    with pytest.raises(TypeError, match="trees"):
        SpeculativeDecoder(target, drafter, trees="2,1")
