"""Every `mamba-draft` command fails in one line: `mamba-draft COMMAND: error: MESSAGE` on stderr, exit 1 (usage
errors exit 2), no traceback unless --debug / MAMBA_DRAFT_DEBUG=1, nothing written to an --out path.

Errors are provoked before any real model work: no model at all where the check comes first, else a tiny saved
Llama whose weights file is garbage.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

import tree_search.cli
from mamba_draft.commands import cli

MAMBA_DRAFT = Path(sys.executable).parent / "mamba-draft"
NO_MODELS = ["--target", "no-such-org/no-such-target", "--drafter", "no-such-org/no-such-drafter", "--prompt", "x"]


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


def fails_in_one_line(capsys, argv, message: str, code: int = 1) -> str:
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mamba-draft {argv[0]}: error: "), err
    assert message in err, err
    return err


def console(args, cwd) -> subprocess.CompletedProcess:
    """The installed console script, offline (a hub id fails at once instead of retrying the network)."""
    environ = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    environ["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(MAMBA_DRAFT), *args], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=120)


def test_console_script_unreachable_hub_id(tmp_path):
    """The real console script: an exception inside run() (here transformers' OSError) is one line, exit 1."""
    hub_id = ["generate", "--target", "no-such-org/no-such-model", "--autoregressive", "--prompt", "x"]
    hub = console(hub_id, tmp_path)
    assert hub.returncode == 1 and hub.stdout == "" and hub.stderr.count("\n") == 1, hub.stderr
    assert hub.stderr.startswith("mamba-draft generate: error: no-such-org/no-such-model is not a local directory "
                                 "and not reachable on the hub"), hub.stderr


def test_missing_model_directories(tmp_path):
    """A command's own usage errors are SystemExit(message): Python prints the one line and exits 1."""
    for flag, argv in (("--target", ["--target", str(tmp_path / "nowhere"), "--autoregressive"]),
                       ("--drafter", ["--target", "no-such-org/t", "--drafter", str(tmp_path / "nowhere")])):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["generate", *argv, "--prompt", "x"])
        assert exit_.value.code.startswith(f"mamba-draft generate: error: {flag} {tmp_path / 'nowhere'} does not exist: ")
        assert "\n" not in exit_.value.code


@pytest.mark.parametrize("extra, message", [
    (["--tree", "3,,2"], "cannot parse tree spec '3,,2'"),
    (["--tree", "(3,2)"], "cannot parse tree spec '(3,2)'"),
    (["--tree", "bandit:3,2//1"], "tree spec '' is empty"),
    (["--tree", ""], "tree spec '' is empty"),  # not the default bandit
    (["--tree", "  "], "is empty: expected comma-separated positive integers"),
    (["--tree", "bandit-time:3,2/x"], "cannot parse tree spec 'x'"),
    (["--tree", "chain:0"], "chain:N takes a positive length"),
    (["--tree", "beam"], "expected auto, none, a shape like 3,2,2,1,1, chain:N, bandit[:A/B/...]"),
    (["--temperature", "inf"], "temperature must be a number >= 0: 0 for greedy, else finite and >= 0.001; got inf"),
    (["--temperature", "nan"], "got nan"),
    (["--temperature", "-0.5"], "got -0.5"),
    (["--temperature", "1e-45"], "(use 0 for greedy decoding)"),
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--top-k", "-3"], "top_k must be an integer >= 0"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device"),
])
def test_bad_generate_arguments_are_one_line_before_any_model(capsys, extra, message):
    fails_in_one_line(capsys, ["generate", *NO_MODELS, *extra], message)


def test_cuda_device_without_cuda_is_one_line(capsys):
    device, message = (("cuda:99", "CUDA device(s)") if torch.cuda.is_available()
                       else ("cuda", "--device cuda: CUDA is not available on this machine"))
    fails_in_one_line(capsys, ["generate", *NO_MODELS, "--device", device], message)


WORDS = "the cat sat on a mat".split()


@pytest.fixture(scope="module")
def corrupt_target(tmp_path_factory):
    """A tiny Llama directory (config, tokenizer) whose model.safetensors is garbage."""
    root = tmp_path_factory.mktemp("corrupt")
    core = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(root / "target")
    LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(root / "target")  # no model to build: the weights are garbage
    (root / "target" / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 8)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n")
    return root / "target", prompts


def test_corrupt_weights_are_one_line_and_nothing_is_written(corrupt_target, capsys, tmp_path):
    target, prompts = corrupt_target
    message = f"cannot load {target}: SafetensorError: "  # the path says which of the models is broken
    fails_in_one_line(capsys, ["generate", "--target", str(target), "--autoregressive", "--prompt", "the cat"], message)
    out = tmp_path / "bench"
    fails_in_one_line(capsys, ["bench", "--target", str(target), "--prompts", str(prompts), "--methods", "ar",
                               "--repeats", "1", "--warmup", "0", "--out", str(out)], message)
    assert not out.exists()


def test_bench_errors_leave_no_output(capsys, tmp_path):
    out = tmp_path / "bench"
    base = ["bench", "--target", "no-such-org/t", "--prompts", str(tmp_path / "p.jsonl"), "--methods", "ar", "--out",
            str(out)]
    fails_in_one_line(capsys, [*base, "--temperature", "inf"], "got inf")
    if not torch.cuda.is_available():
        fails_in_one_line(capsys, [*base, "--device", "cuda"], "--device cuda")
    assert not out.exists()


def test_debug_flag_and_environment_show_the_exception(capsys, monkeypatch):
    bad = ["generate", *NO_MODELS, "--tree", "3,,2"]
    with pytest.raises(ValueError, match="cannot parse tree spec"):
        cli.main([*bad, "--debug"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="cannot parse tree spec"):
        cli.main(bad)
    monkeypatch.setenv(cli.DEBUG_ENV, "0")  # "0" is off
    fails_in_one_line(capsys, bad, "cannot parse tree spec")


def test_keyboard_interrupt_exits_130_quietly(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tree_search.cli, "run", interrupted)
    assert cli.main(["generate", "--target", "t", "--prompt", "x"]) == 130
    assert capsys.readouterr() == ("", "")
    with pytest.raises(KeyboardInterrupt):
        cli.main(["generate", "--target", "t", "--prompt", "x", "--debug"])


@pytest.mark.parametrize("error, line", [
    (OSError("first line\n  second line"), "first line second line"),  # folded onto one line
    (KeyError("x"), "KeyError: 'x'"),  # a bare message says too little: the type is named
    (AssertionError(), "AssertionError"),
])
def test_messages_are_folded_to_one_line(capsys, monkeypatch, error, line):
    def failing(args):
        raise error

    monkeypatch.setattr(tree_search.cli, "run", failing)
    assert fails_in_one_line(capsys, ["generate", "--target", "t", "--prompt", "x"], line) == \
        f"mamba-draft generate: error: {line}\n"


def test_debug_is_an_option_of_every_command():
    for name in cli.COMMANDS:
        parser = cli.build_parser(name)
        assert "--debug" in parser._option_string_actions, name
    autojudge = cli.build_parser("autojudge")  # sub-actions take it too, and keep a command-level value
    train = ["train", "--data", "d", "--out", "o"]
    assert autojudge.parse_args([*train, "--debug"]).debug
    assert autojudge.parse_args(["--debug", *train]).debug
    assert not autojudge.parse_args(train).debug


def test_autojudge_mine_writes_nothing_when_the_target_does_not_load(tmp_path, capsys):
    """The mining manifest is written only after both models loaded: a bad target leaves no --out behind."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    out = tmp_path / "mined"
    fails_in_one_line(capsys, ["autojudge", "mine", "--target", str(tmp_path / "nowhere"), "--drafter",
                               str(tmp_path / "nodraft"), "--prompts", str(prompts), "--out", str(out)], "nowhere")
    assert not out.exists()
    fails_in_one_line(capsys, ["autojudge", "mine", "--target", "x", "--drafter", "y", "--prompts", str(prompts),
                               "--out", str(out), "--device", "cuda:99"], "--device cuda:99")
    assert not out.exists()
