"""`SpeculativeGenerator`: names in, text out, with the defaults `mamba-draft generate` uses (one function decides
them for both), streaming, batches, and one clear error per bad input before any model runs."""
from __future__ import annotations

import json

import pytest
import torch

import mamba_draft.devices
import tree_search.generator as generator_module
from mamba_draft.commands.cli import main
from tests.helpers.drafters import lean_drafter
from tests.helpers.training_fixtures import CHATML, tiny_chat_target
from tree_search import SpeculativeGenerator, generate, generate_autoregressive, run_defaults
from tree_search.policy import spec_of
from tree_search.prompts import encode_prompt

PROMPTS = ["the cat sat on the mat", "a dog ran in the park and then"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny chat target saved with its tokenizer, and a drafter on its embedding saved without it."""
    root = tmp_path_factory.mktemp("generator")
    tokenizer, target = tiny_chat_target(root / "target", CHATML)
    lean_drafter(root / "drafter", target)
    other = tiny_chat_target(root / "other", CHATML)[1]  # same shapes, other weights
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    return root, tokenizer, target, other


@pytest.fixture
def bf16(monkeypatch):
    """Force this CPU's answer to "native bf16 products?" (the one fact the dtype default reads)."""
    def force(on: bool):
        monkeypatch.setattr(mamba_draft.devices, "native_bf16", lambda device="cpu": on)
    return force


@pytest.mark.parametrize("native", [False, True])
def test_the_cli_and_python_choose_the_same_defaults(pair, bf16, monkeypatch, capsys, native):
    root, _, _, _ = pair
    bf16(native)
    made = []
    init = SpeculativeGenerator.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SpeculativeGenerator, "__init__", spy)
    python = SpeculativeGenerator(str(root / "target"), drafter=str(root / "drafter"))
    assert main(["generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompt",
                 PROMPTS[0], "--max-new-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cli = made[-1]
    defaults = run_defaults()
    assert defaults.dtype == (torch.bfloat16 if native else torch.float32)
    assert defaults.attention == ("row_stable" if native else "sdpa")
    for chosen in (python, cli):
        assert chosen.defaults == defaults
        assert chosen.target.dtype == defaults.dtype and chosen.drafter.dtype == defaults.dtype
        assert chosen.target.config._attn_implementation == defaults.attention
        assert spec_of(chosen.decoder.policy) == "auto" and chosen.decoder.policy.persistent  # learns over calls
    assert report["target_dtype"] == str(defaults.dtype).removeprefix("torch.")


def test_text_in_text_out_equals_the_low_level_call(pair, bf16):
    root, tokenizer, target, _ = pair
    bf16(False)
    gen = SpeculativeGenerator(str(root / "target"), drafter=str(root / "drafter"), tree="2,1")
    result = gen.generate(PROMPTS[0], max_new_tokens=12)
    ids = torch.tensor([encode_prompt(tokenizer, PROMPTS[0])])
    plain = generate_autoregressive(target, ids, max_new_tokens=12)
    assert result.token_ids == plain.new_tokens[0].tolist()  # greedy: the target's own decoding
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.stats.new_tokens == 12 and result.stats.verifier == "greedy"
    low = generate(gen.target, gen.drafter, ids, max_new_tokens=12, tree="2,1")
    assert result.token_ids == low.new_tokens[0].tolist()
    # chat messages: the same user turn through the template
    chat = gen.generate([{"role": "user", "content": PROMPTS[0]}], max_new_tokens=12)
    assert chat.token_ids == result.token_ids
    # a list of prompts is a batch: one result each, each what that prompt gives alone
    batch = gen.generate(PROMPTS, max_new_tokens=12)
    assert [r.token_ids for r in batch] == [gen.generate(p, max_new_tokens=12).token_ids for p in PROMPTS]


def test_stream_yields_the_text_as_rounds_commit(pair, bf16):
    root, _, _, _ = pair
    bf16(False)
    gen = SpeculativeGenerator(str(root / "target"), drafter=str(root / "drafter"), tree="1,1")
    pieces = list(gen.stream(PROMPTS[1], max_new_tokens=16))
    assert len(pieces) > 1 and "".join(pieces).strip() == gen.generate(PROMPTS[1], max_new_tokens=16).text.strip()
    with pytest.raises(ValueError, match="stream takes one prompt"):
        next(gen.stream(PROMPTS))
    with pytest.raises(ValueError, match="max_new_tokens"):  # an error in the worker reaches the caller
        list(gen.stream(PROMPTS[1], max_new_tokens=0))


def test_loaded_models_work_too(pair, bf16):
    root, tokenizer, target, _ = pair
    gen = SpeculativeGenerator(target, drafter=str(root / "drafter"), tokenizer=tokenizer, tree="1,1")
    assert gen.target is target and gen.drafter.dtype == target.dtype
    plain = SpeculativeGenerator(target, tokenizer=tokenizer)  # no drafter: plain decoding
    assert plain.generate(PROMPTS[0], max_new_tokens=8).token_ids == \
        gen.generate(PROMPTS[0], max_new_tokens=8).token_ids


def test_bad_input_is_one_clear_error_before_any_model_runs(pair, monkeypatch, tmp_path):
    root, tokenizer, target, other = pair

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("mamba_draft.targets.load_causal_lm", never)
    with pytest.raises(ValueError, match="target .*nowhere does not exist: give an HF model directory"):
        SpeculativeGenerator(str(tmp_path / "nowhere"), drafter=str(root / "drafter"))
    with pytest.raises(ValueError, match="drafter .*nowhere does not exist"):
        SpeculativeGenerator(str(root / "target"), drafter=str(tmp_path / "nowhere"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf model"):
        SpeculativeGenerator(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="is not a directory"):
        SpeculativeGenerator(target, drafter=str(tmp_path / "weights.bin"), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        SpeculativeGenerator(target)
    monkeypatch.undo()
    # a drafter trained on another target's embedding is refused by name at load
    with pytest.raises(ValueError, match="was trained on the embedding of"):
        SpeculativeGenerator(other, drafter=str(root / "drafter"), tokenizer=tokenizer)
    gen = SpeculativeGenerator(target, tokenizer=tokenizer)
    monkeypatch.setattr(gen.decoder, "speculate", never)
    monkeypatch.setattr(gen.decoder, "decode_plainly", never)
    for bad, message in [([{"role": "user"}], "message 0 must be"), ([{"role": "robot", "content": "hi"}],
                         "message 0 must be"), ([], "a prompt is a string"), (3, "a prompt is a string")]:
        with pytest.raises(ValueError, match=message) as err:
            gen.generate(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="system message in the messages"):
        gen.generate([{"role": "user", "content": "hi"}], system_prompt="be brief")


def test_run_defaults_refuses_a_device_it_cannot_use():
    with pytest.raises(ValueError, match="not a device"):
        run_defaults("tpu9")
    assert generator_module.run_defaults("cpu", "float32").dtype == torch.float32


@pytest.mark.parametrize("native", [False, True])
def test_auto_runs_a_llama_gguf_in_fp32_on_a_cpu_and_says_so_once(bf16, capsys, tmp_path, native):
    """The compiled step reads a GGUF's codes in either dtype and fp32 skips bf16's rounding of every rebuilt weight:
    `auto` picks fp32 for the shipped Llama GGUF, in one line; other targets keep the device's default."""
    from mamba_draft import targets

    bf16(native)
    targets._say_auto_dtype.cache_clear()
    assert run_defaults("cpu", "auto", "smollm2").dtype == torch.float32
    assert run_defaults("cpu", "auto", "smollm2").dtype == torch.float32
    said = capsys.readouterr().err.strip().splitlines()
    assert said == (["mamba-draft: --dtype auto runs smollm2 in float32: the compiled CPU step reads its GGUF codes "
                     "either way, and fp32 skips rounding each rebuilt weight to bf16 (faster on every CPU kind "
                     "measured); --dtype bfloat16 keeps bf16"] if native else [])
    assert run_defaults("cpu", "auto", str(tmp_path)).dtype == (torch.bfloat16 if native else torch.float32)
    assert run_defaults("cpu", "bfloat16", "smollm2").dtype == torch.bfloat16  # asked for: kept
