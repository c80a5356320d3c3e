"""Sampling arguments left unset take the target's generation_config exactly as `target.generate` does.

The target here samples by default (generation_config.do_sample) and leaves top_k unset, so transformers applies its
default top-k of 50; over a 256-token vocabulary about 70% of the first token's mass lies outside that top-50, so a
sampler that ignored the default would leave it in most of the seeded draws below.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from mamba_draft.benchmarks.methods import Models, parse_method, run_hf
from mamba_draft.commands.cli import main
from tests.helpers.tree_models import random_drafter, tiny_llama, word_tokenizer
from tests.test_generate_cli import cli_fp32  # noqa: F401  (fixture: the CLI in fp32 on every CPU kind)
from tree_search.generate import generate, generate_autoregressive
from tree_search.sampling import HF_DEFAULTS, SamplingParams, resolve_sampling

VOCAB = 256
DRAWS = 100
PROMPT = torch.tensor([[3]])


def sampling_target(**generation) -> torch.nn.Module:
    target = tiny_llama(vocab=VOCAB)
    target.generation_config.do_sample = True
    for key, value in generation.items():
        setattr(target.generation_config, key, value)
    return target


@pytest.fixture(scope="module")
def target():
    return sampling_target()


@pytest.fixture(scope="module")
def top50(target):
    with torch.no_grad():
        logits = target(PROMPT).logits[0, -1]
    return set(torch.topk(logits, 50).indices.tolist())


def first_tokens(run) -> list[int]:
    return [run(seed) for seed in range(DRAWS)]


def test_our_defaults_are_transformers_defaults():
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is None:
        pytest.skip("this transformers keeps its defaults elsewhere")
    assert {key: defaults()[key] for key in HF_DEFAULTS} == HF_DEFAULTS


@pytest.mark.parametrize("generation, explicit, expected", [
    ({}, {}, SamplingParams(0.0, 0, 1.0)),  # transformers' default: greedy
    ({"temperature": 0.7}, {}, SamplingParams(0.0, 0, 1.0)),  # a temperature without do_sample stays greedy
    ({"do_sample": True}, {}, SamplingParams(1.0, 50, 1.0)),
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9}, {}, SamplingParams(0.6, 20, 0.9)),
    ({"do_sample": True, "top_k": 0}, {}, SamplingParams(1.0, 0, 1.0)),
    ({"do_sample": True, "temperature": 0.6}, {"temperature": 0.0}, SamplingParams(0.0, 0, 1.0)),  # explicit wins
    ({"do_sample": True, "top_k": 20}, {"top_k": 0, "top_p": 0.5}, SamplingParams(1.0, 0, 0.5)),
    ({}, {"temperature": 0.8}, SamplingParams(0.8, 50, 1.0)),  # sampling asked for: the default top-k applies
    ({}, {"temperature": 0.0, "top_k": 5}, SamplingParams(0.0, 5, 1.0)),
])
def test_resolve_sampling(generation, explicit, expected):
    target = tiny_llama(vocab=8, hidden=8, layers=1)
    for key, value in generation.items():
        setattr(target.generation_config, key, value)
    assert resolve_sampling(target, **explicit) == expected
    if not generation:
        assert resolve_sampling(None, **explicit) == expected  # no target: transformers' defaults alone


@pytest.mark.parametrize("explicit, message", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
])
def test_explicit_values_are_validated_even_when_greedy(explicit, message):
    with pytest.raises(ValueError, match=message):
        resolve_sampling(tiny_llama(vocab=8, hidden=8, layers=1), **explicit)


def test_our_sampler_applies_the_default_top_k_and_top_k_0_turns_it_off(target, top50, tmp_path):
    drafter = random_drafter(tmp_path, vocab=VOCAB)

    def autoregressive(**kw):
        return lambda seed: int(generate_autoregressive(target, PROMPT, max_new_tokens=1, seed=seed, **kw).new_tokens[0, 0])

    def speculative(**kw):
        return lambda seed: int(generate(target, drafter, PROMPT, max_new_tokens=1, tree="2,1", seed=seed,
                                         **kw).new_tokens[0, 0])

    assert generate(target, drafter, PROMPT, max_new_tokens=1, tree="2,1").stats.verifier == "sampling"
    for run in (autoregressive, speculative):
        for kwargs in ({}, {"temperature": 1.0}):  # all defaults; sampling asked for, top-k left to the default
            drawn = set(first_tokens(run(**kwargs)))
            assert drawn <= top50 and len(drawn) > 10, (run.__name__, kwargs)  # sampled, within the top-50
        outside = [t for t in first_tokens(run(top_k=0)) if t not in top50]
        assert len(outside) > DRAWS // 3, run.__name__  # about 70% of the mass


def test_transformers_does_the_same_and_explicit_kwargs_win(target, top50):
    """The reference: target.generate samples from the top-50 by default; run_hf (bench) passes resolved values."""
    def hf(**kw):
        def run(seed):
            torch.manual_seed(seed)
            return int(target.generate(PROMPT, max_new_tokens=1, pad_token_id=0, **kw)[0, -1])
        return run

    drawn = set(first_tokens(hf()))
    assert drawn <= top50 and len(drawn) > 10
    models = Models(target=target)

    def bench_hf(sampling):
        def run(seed):
            torch.manual_seed(seed)
            return run_hf(parse_method("hf-ar"), models, PROMPT, 1, sampling, [], 0)[0][0]
        return run

    resolved = resolve_sampling(target)
    assert set(first_tokens(bench_hf({"temperature": resolved.temperature, "top_k": resolved.top_k,
                                      "top_p": resolved.top_p}))) <= top50
    off = first_tokens(bench_hf({"temperature": 1.0, "top_k": 0, "top_p": 1.0}))
    assert sum(t not in top50 for t in off) > DRAWS // 3


WORDS = "the cat dog sat ran on a mat log and then it was big small red blue green".split()


@pytest.fixture(scope="module")
def saved_sampling_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling_cli")
    tokenizer = word_tokenizer(WORDS)
    target = sampling_target(temperature=0.9)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    random_drafter(root / "drafter", vocab=VOCAB)
    return root, target, tokenizer


def test_cli_defaults_are_the_generation_config(saved_sampling_target, capsys):
    root, target, tokenizer = saved_sampling_target
    base = ["generate", "--target", str(root / "target"), "--prompt", "the cat", "--max-new-tokens", "5", "--seed", "4",
            "--json", "--device", "cpu"]

    def run(*extra):
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    report = run("--autoregressive")
    assert report["sampling"] == {"temperature": 0.9, "top_k": 50, "top_p": 1.0}
    prompt = tokenizer("the cat", return_tensors="pt").input_ids
    same = generate_autoregressive(target, prompt, max_new_tokens=5, seed=4)  # the library's defaults, same draws
    assert report["tokens"] == same.new_tokens[0].tolist()
    assert run("--autoregressive", "--top-k", "0", "--top-p", "0.8")["sampling"] == {"temperature": 0.9, "top_k": 0,
                                                                                      "top_p": 0.8}
    assert run("--autoregressive", "--temperature", "0")["sampling"]["temperature"] == 0.0
    speculative = run("--drafter", str(root / "drafter"), "--tree", "2,1")
    assert speculative["verifier"] == "sampling" and speculative["sampling"]["top_k"] == 50
    # a greedy-only verifier is refused once the target turns out to sample
    with pytest.raises(ValueError, match="verifier 'greedy' is for temperature 0"):
        main([*base, "--drafter", str(root / "drafter"), "--tree", "2,1", "--verifier", "greedy"])
