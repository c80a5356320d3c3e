"""Demo corpus: file-level train/held-out split, locally trained tokenizer, completion prompts."""
from __future__ import annotations

import json

import pytest

from mamba_draft.benchmarks.corpus import CorpusConfig, build_corpus, completion_prompts, is_heldout, source_files


def make_tree(root):
    for i in range(30):
        pkg = root / ("pkg" if i % 2 else "") / ("tests" if i == 7 else "")
        pkg.mkdir(parents=True, exist_ok=True)
        body = "".join(f"\n\ndef function_{i}_{j}(a, b):\n    return a * {j} + b\n" for j in range(12))
        (pkg / f"mod_{i}.py").write_text(f'"""Module {i}."""\nimport os\n' + body)
    (root / "notes.txt").write_text("not python")


def test_split_is_by_file_and_stable(tmp_path):
    make_tree(tmp_path)
    files = source_files(tmp_path)
    assert all(f.suffix == ".py" and "tests" not in f.parts for f in files) and len(files) == 29
    names = [f.relative_to(tmp_path).as_posix() for f in files]
    assert [is_heldout(n, 0.3) for n in names] == [is_heldout(n, 0.3) for n in names]
    assert 0 < sum(is_heldout(n, 0.3) for n in names) < len(names)


def test_build_corpus_writes_data_tokenizer_and_heldout_prompts(tmp_path):
    from transformers import AutoTokenizer

    make_tree(tmp_path / "src")
    cfg = CorpusConfig(root=str(tmp_path / "src"), heldout_fraction=0.3, vocab_size=300, n_prompts=4, prompt_chars=120)
    paths = build_corpus(tmp_path / "out", cfg)
    train = [json.loads(line)["text"] for line in paths["train"].read_text().splitlines()]
    heldout = [json.loads(line)["text"] for line in paths["heldout"].read_text().splitlines()]
    assert train and heldout and not set(train) & set(heldout)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    assert len(tok) <= 300 and tok.eos_token == "<|eos|>"
    assert tok.decode(tok(heldout[0])["input_ids"]) == heldout[0]  # byte-level BPE round-trips source exactly
    prompts = [json.loads(line) for line in paths["prompts"].read_text().splitlines()]
    assert len(prompts) == 4
    heldout_text, train_text = "\n".join(heldout), "\n".join(train)
    for p in prompts:
        assert p["category"] in ("def", "class") and p["prompt"].rstrip().endswith(":")
        header = p["prompt"].rstrip("\n").splitlines()[-1]
        assert header in heldout_text and header not in train_text


def test_chunks_split_at_blank_lines_without_trailing_newline():
    from mamba_draft.benchmarks.corpus import chunk_source

    text = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(10))
    chunks = chunk_source(text, lines_per_chunk=6)
    assert len(chunks) > 1 and all(not c.endswith("\n") and c.startswith("def ") for c in chunks)
    nonblank = lambda t: [line for line in t.splitlines() if line.strip()]  # noqa: E731
    assert [line for c in chunks for line in nonblank(c)] == nonblank(text)  # nothing lost or reordered


def test_too_few_prompts_is_an_error():
    with pytest.raises(ValueError, match="only 0 completion prompts"):
        completion_prompts(["x = 1\n"], n=3, prompt_chars=100)


def test_missing_root_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus root is not a directory"):
        source_files(tmp_path / "nope")
