"""Strict inputs: tree specs, sampling values, and generation_config settings tree_search does not apply.

Every bad value is a one-line ValueError naming it, raised before any model runs; a target whose
generation_config asks `target.generate` for a logits processor we do not reproduce is refused rather than
decoded differently.
"""
from __future__ import annotations

import math

import pytest
import torch

from mamba_draft.tree import TreeConfig
from tests.helpers.tree_models import hf_greedy, random_drafter, tiny_llama
from tree_search.generate import generate, generate_autoregressive
from tree_search.sampling import MIN_TEMPERATURE, SamplingParams, logits_to_probs, resolve_sampling

VOCAB = 32
PROMPT = torch.tensor([[1, 2, 3, 1, 2, 3]])


def one_line_error(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("spec, expected", [
    ("3,2,2,1,1", (3, 2, 2, 1, 1)), ("3, 2", (3, 2)), (" 4 ,1 ", (4, 1)), ("1", (1,)),
    ((3, 2), (3, 2)), ([4], (4,)), (TreeConfig((2, 1)), (2, 1)),
])
def test_tree_spec_accepted_forms(spec, expected):
    assert TreeConfig.parse(spec).branching == expected


@pytest.mark.parametrize("spec, message", [
    ("3,,2", "cannot parse tree spec '3,,2'"), ("", "tree spec '' is empty"), ("  ", "is empty"),
    ("(3,2)", r"cannot parse tree spec '\(3,2\)'"), ("[3,2]", "cannot parse"), ("3;2", "cannot parse"),
    ("3,2,", "cannot parse"), (",3", "cannot parse"), ("3 2", "cannot parse"), ("3,-1", "cannot parse"),
    ("3,x", "cannot parse"), ("2.5", "cannot parse"), ("\u0663,2", "cannot parse"),  # Arabic-Indic 3: ASCII only
    ("3,0", "tree spec '3,0': .*positive"), ("64,64", "tree spec '64,64': .*budget"),
    ((3, 0), r"tree spec \(3, 0\): .*positive"), ([2.5], "positive"), ((True,), "positive"),
    (3, "cannot parse tree spec 3"), (None, "cannot parse tree spec None"),
])
def test_tree_spec_refused_forms(spec, message):
    one_line_error(lambda: TreeConfig.parse(spec), message)


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, -1.0, -1e-9, True, "0.5", None])
def test_bad_temperatures_are_refused(temperature):
    one_line_error(lambda: SamplingParams(temperature),
                   "temperature must be a number >= 0: 0 for greedy, else finite and >= 0.001; got ")


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-4, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_refused_with_a_pointer_to_greedy(temperature):
    """The chosen rule (SamplingParams' docstring): 0 < T < 1e-3 is refused; before, 1e-45 gave all-zero tokens."""
    one_line_error(lambda: SamplingParams(temperature), r"got .*\(use 0 for greedy decoding\)")
    one_line_error(lambda: resolve_sampling(None, temperature), "use 0 for greedy")


def test_smallest_accepted_temperature_is_finite_and_sharp():
    logits = torch.tensor([[3e4, -3e4, 1.0, 2.0], [0.5, 0.25, 0.0, 0.75]])
    probs = logits_to_probs(logits, SamplingParams(MIN_TEMPERATURE))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, logits_to_probs(logits, SamplingParams(0.0)))  # that cold, one-hot on the argmax


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"), ({"top_p": -0.1}, "top_p must be in"),
    ({"top_p": math.nan}, "top_p must be in"), ({"top_p": True}, "top_p must be in"),
    ({"top_k": -1}, "top_k must be an integer >= 0"), ({"top_k": 2.0}, "top_k must be an integer"),
    ({"top_k": True}, "top_k must be an integer"),
])
def test_bad_top_p_and_top_k_are_refused(kwargs, message):
    one_line_error(lambda: resolve_sampling(None, **kwargs), message)
    one_line_error(lambda: resolve_sampling(None, temperature=0.7, **kwargs), message)


def test_generation_config_temperature_is_checked_too():
    target = tiny_llama(vocab=8, hidden=8, layers=1)
    target.generation_config.do_sample = True
    target.generation_config.temperature = 1e-45
    one_line_error(lambda: resolve_sampling(target), "use 0 for greedy")
    assert resolve_sampling(target, temperature=0.0).greedy  # an explicit value wins, as in target.generate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tiny_llama(vocab=VOCAB, hidden=16, layers=1)
    drafter = random_drafter(tmp_path_factory.mktemp("d"), vocab=VOCAB, hidden=16, layers=1)
    return target, drafter


# setting -> (a value target.generate applies, the value that turns it off); each changes target.generate's output
# (penalties, bans and minimum lengths are applied: tests/test_processors.py)
UNAPPLIED = {
    "forced_bos_token_id": (5, None),
    "forced_eos_token_id": (5, None),
    "exponential_decay_length_penalty": ((2, 1.5), None),
    "guidance_scale": (1.5, 1.0),
    "num_beams": (2, 1),
    "stop_strings": (["x"], None),
}


@pytest.mark.parametrize("name", UNAPPLIED)
def test_unapplied_generation_config_settings_are_refused(models, name, monkeypatch):
    target, drafter = models
    on, off = UNAPPLIED[name]
    monkeypatch.setattr(target.generation_config, name, on, raising=False)
    message = one_line_error(lambda: generate(target, drafter, PROMPT, max_new_tokens=4, tree="2,1"),
                             f"generation_config sets {name} = ")
    assert f"set target.generation_config.{name} = {off}" in message and "to decode without it" in message
    one_line_error(lambda: generate_autoregressive(target, PROMPT, max_new_tokens=4), name)
    one_line_error(lambda: resolve_sampling(target, temperature=0.8), name)  # greedy or sampling alike
    monkeypatch.setattr(target.generation_config, name, off, raising=False)
    assert resolve_sampling(target) == SamplingParams(0.0)  # the neutral value decodes as before


@pytest.mark.parametrize("name, on", [("min_p", 0.1), ("typical_p", 0.9), ("epsilon_cutoff", 0.01),
                                      ("eta_cutoff", 0.01), ("top_h", 0.5)])
def test_sampling_warpers_are_refused_only_when_sampling(models, name, on, monkeypatch):
    """transformers applies these warpers only when it samples, so a greedy decode is unaffected by them."""
    target, _ = models
    monkeypatch.setattr(target.generation_config, name, on, raising=False)
    assert resolve_sampling(target) == SamplingParams(0.0)
    one_line_error(lambda: resolve_sampling(target, temperature=0.7), f"sets {name} = ")
    monkeypatch.setattr(target.generation_config, "do_sample", True)
    one_line_error(lambda: resolve_sampling(target), f"sets {name} = ")


def test_contrastive_search_is_refused_when_greedy(models, monkeypatch):
    target, _ = models
    monkeypatch.setattr(target.generation_config, "penalty_alpha", 0.6, raising=False)
    monkeypatch.setattr(target.generation_config, "top_k", 4)
    one_line_error(lambda: resolve_sampling(target), "sets penalty_alpha = 0.6")
    assert resolve_sampling(target, temperature=0.7).top_k == 4  # sampling ignores penalty_alpha


def test_neutral_values_of_every_setting_are_accepted(models, monkeypatch):
    target, _ = models
    for name, (_, off) in UNAPPLIED.items():
        monkeypatch.setattr(target.generation_config, name, off, raising=False)
    monkeypatch.setattr(target.generation_config, "min_length", 1)  # a prompt has at least one token
    monkeypatch.setattr(target.generation_config, "typical_p", 1.0, raising=False)
    assert resolve_sampling(target) == SamplingParams(0.0)
    assert resolve_sampling(target, temperature=0.5) == SamplingParams(0.5, 50, 1.0)
