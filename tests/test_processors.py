"""Logits processors inside verification: the settings a model's generation_config carries (and the same passed per
call) give speculative output identical to `target.generate` with them, for trees, chains, a bandit and batches;
sampling with them follows the processed distribution; the OpenAI penalties and logit bias equal plain decoding."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tests.helpers.sampling_law import assert_follows
from tests.helpers.tree_models import aligned_drafter, hf_greedy, prompts, random_drafter, tiny_causal_lm, tiny_llama
from tree_search.generate import generate, generate_autoregressive
from tree_search.processors import Shaping, shaping_of
from tree_search.sampling import SamplingParams, logits_to_probs

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)

NEW = 40
TREES = ["1,1,1,1,1", "3,2,2,1,1", "4", "bandit"]
# generation_config field -> its value, given the new tokens the target writes without it (so that it matters)
SETTINGS = {
    "repetition_penalty": lambda new: 1.3,
    "no_repeat_ngram_size": lambda new: 2,
    "suppress_tokens": lambda new: [new[0][3], new[1][5]],
    "bad_words_ids": lambda new: [[new[0][2]], new[1][4:6], new[2][1:4]],  # one token, two and three in a row
    "min_new_tokens": lambda new: 25,
    "min_length": lambda new: 24,  # prompts of 1-12 tokens
    "begin_suppress_tokens": lambda new: [new[0][0], new[1][0]],
    "sequence_bias": lambda new: [[[new[0][1]], -10.0], [[new[1][0], new[1][1]], 8.0]],
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for kind in ("llama", "qwen2", "neox"):
        target = tiny_causal_lm(kind)
        out[kind] = (target, aligned_drafter(root / kind, target))
    return out


def configured(target, name: str, value, eos: int | None):
    """`target.generation_config` with one setting and an EOS -> the undo."""
    config = target.generation_config
    before = {name: getattr(config, name, None), "eos_token_id": config.eos_token_id}
    setattr(config, name, value)
    config.eos_token_id = eos
    return lambda: [setattr(config, k, v) for k, v in before.items()]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "neox"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_generation_config_settings_are_applied_losslessly(pairs, kind, name):
    """Each setting in the target's generation_config (refused before): every tree, a bandit, a batch and plain
    decoding give target.generate's tokens on 8 prompts, which the setting changes."""
    target, drafter = pairs[kind]
    ps = prompts(64, 8, seed=3)
    # the length settings need an EOS: one the target writes early, so that they matter
    eos = int(hf_greedy(target, ps[0], 4)[0, -1]) if name.startswith("min_") else None
    without = [hf_greedy(target, p, NEW, eos_token_id=eos) for p in ps]
    value = SETTINGS[name]([w[0, p.shape[1]:].tolist() for w, p in zip(without, ps)])
    undo = configured(target, name, value, eos)
    try:
        refs = [hf_greedy(target, p, NEW, eos_token_id=eos) for p in ps]
        assert any(not torch.equal(a, b) for a, b in zip(refs, without)), name  # the setting changes the output
        for tree in TREES:
            for p, ref in zip(ps, refs):
                assert torch.equal(generate(target, drafter, p, max_new_tokens=NEW, tree=tree).tokens, ref), (tree, p)
        batch = generate(target, drafter, [p[0].tolist() for p in ps], max_new_tokens=NEW, tree="3,2,2,1,1")
        assert [row.tokens[0].tolist() for row in batch.rows] == [ref[0].tolist() for ref in refs]
        assert torch.equal(generate_autoregressive(target, ps[0], max_new_tokens=NEW).tokens, refs[0])
    finally:
        undo()


def test_settings_passed_per_call_equal_target_generate_with_them(pairs):
    target, drafter = pairs["llama"]
    for p in prompts(64, 4, seed=8):
        ref = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW, do_sample=False,
                              repetition_penalty=1.4, no_repeat_ngram_size=3, suppress_tokens=[4], pad_token_id=0)
        out = generate(target, drafter, p, max_new_tokens=NEW, repetition_penalty=1.4, no_repeat_ngram_size=3,
                       suppress_tokens=[4])
        assert torch.equal(out.tokens, ref)


def test_openai_penalties_and_logit_bias_equal_plain_decoding(pairs):
    """frequency / presence penalties on the new tokens and a logit bias: speculative output equals plain decoding
    with them, which follows the OpenAI definition (a hand-written greedy loop), and they change the output."""
    target, drafter = pairs["llama"]
    options = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {3: 4.0, 10: -100.0}}
    for p in prompts(64, 3, seed=9):
        ids = p[0].tolist()
        with torch.no_grad():
            for _ in range(24):
                logits = target(torch.tensor([ids])).logits[0, -1].float()
                new = torch.tensor(ids[p.shape[1]:], dtype=torch.long)
                counts = torch.bincount(new, minlength=logits.numel()).float()
                logits = logits - 1.5 * counts - 0.5 * (counts > 0).float()
                logits[3] += 4.0
                logits[10] -= 100.0
                ids.append(int(logits.argmax()))
        expected = torch.tensor([ids])
        assert torch.equal(generate_autoregressive(target, p, max_new_tokens=24, **options).tokens, expected)
        for tree in ("3,2,2,1,1", "bandit"):
            assert torch.equal(generate(target, drafter, p, max_new_tokens=24, tree=tree, **options).tokens, expected)
        assert not torch.equal(generate_autoregressive(target, p, max_new_tokens=24).tokens, expected)


def test_sampling_with_a_repetition_penalty_follows_the_processed_law(tmp_path):
    """Lossless sampling with a penalty: the first two tokens of 6,000 seeded rows follow the target's distribution
    processed as transformers does (the second after the first: the penalty then covers it)."""
    vocab = 8
    target = tiny_llama(vocab=vocab, hidden=16, layers=1, seed=11, head_scale=3.0)
    drafter = random_drafter(tmp_path, vocab=vocab, hidden=16, layers=1, seed=12, head_scale=3.0)
    target.generation_config.repetition_penalty = 2.0
    prompt, runs, params = [5, 1, 6], 6000, SamplingParams(0.9)
    penalty = RepetitionPenaltyLogitsProcessor(2.0)
    with torch.no_grad():
        def law(ids):
            return logits_to_probs(penalty(torch.tensor([ids]), target(torch.tensor([ids])).logits[:, -1].float())[0],
                                   params)
        first = law(prompt)
        exact = torch.stack([first[a] * law(prompt + [a]) for a in range(vocab)]).double()
    result = generate(target, drafter, [prompt] * runs, max_new_tokens=2, tree="3,2", temperature=0.9, top_k=0,
                      seed=0)
    drawn = torch.tensor([t[0] * vocab + t[1] for t in result.new_tokens])
    assert_follows(torch.bincount(drawn, minlength=vocab * vocab).double().view(vocab, vocab) / runs, exact, runs)


def test_bad_settings_are_refused_in_one_line(pairs):
    target, drafter = pairs["llama"]
    for options, message in (({"repetition_penalty": 0.0}, "repetition_penalty out of range: 0.0"),
                             ({"presence_penalty": 3.0}, "presence_penalty out of range: 3.0")):
        with pytest.raises(ValueError, match=message) as err:
            generate(target, drafter, torch.tensor([[1, 2]]), max_new_tokens=4, **options)
        assert "\n" not in str(err.value)
    assert not Shaping().active and shaping_of(target.generation_config) == Shaping()
    assert shaping_of(None, logit_bias={"3": 1}).logit_bias == ((3, 1.0),)
