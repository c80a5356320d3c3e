"""The repository is self-contained and the held-out rule is enforced by code.

Spec-Bench ships inside the package; odd question ids are evaluation prompts that no training, distillation,
prompt-synthesis or tuning path can read; no file points outside the repository."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from mamba_draft.heldout import (SPEC_BENCH, heldout_texts, is_heldout, is_heldout_text, overlaps_heldout,
                                 read_spec_bench)

REPO = Path(__file__).resolve().parents[1]
RECORDS = read_spec_bench()
ODD = [r for r in RECORDS if is_heldout(r)]
EVEN = [r for r in RECORDS if not is_heldout(r)]


def test_spec_bench_ships_inside_the_package():
    assert SPEC_BENCH.is_relative_to(REPO / "mamba_draft")
    assert len(RECORDS) == 480 and len(ODD) == len(EVEN) == 240
    categories = {r["category"] for r in RECORDS}
    assert len(categories) == 13 and categories == {r["category"] for r in ODD}
    assert (SPEC_BENCH.parent / "SPEC_BENCH.md").is_file()  # where it comes from, its license
    packaged = Path(__import__("mamba_draft").__file__).parent / "data" / SPEC_BENCH.name
    assert packaged.is_file()


def test_heldout_text_matching_is_whitespace_and_case_blind_and_covers_every_turn():
    first, second = ODD[0]["turns"][0], ODD[0]["turns"][-1]
    assert is_heldout_text(first) and is_heldout_text(second)
    assert is_heldout_text("  " + first.upper().replace(" ", "\n ") + " ")
    assert not any(is_heldout_text(r["turns"][0]) for r in EVEN)
    assert len(heldout_texts()) >= len(ODD)


def test_generated_prompts_near_a_heldout_question_are_caught():
    question = max((r["turns"][0] for r in ODD), key=len)
    words = question.split()
    quoted = "Hi! Could you help: " + " ".join(words[3:14]) + " thanks"
    assert overlaps_heldout(quoted)
    assert not overlaps_heldout("Write a short poem about autumn leaves falling in a quiet park at dusk.")
    assert not any(overlaps_heldout(r["turns"][0]) for r in EVEN[:40] if r["category"] == "writing")


def test_training_prompts_refuse_odd_ids_and_renumbered_copies():
    from mamba_draft.benchmarks.real_pair import training_prompts
    from mamba_draft.targets import SHIPPED_TARGET, load_tokenizer

    renumbered = [{**r, "question_id": 10_000 + 2 * i} for i, r in enumerate(ODD[:5])]  # even ids, odd texts
    train = training_prompts(RECORDS + renumbered, load_tokenizer(SHIPPED_TARGET), 10**6, None)
    assert len(train) == len(EVEN)
    assert not any(is_heldout(r) or is_heldout_text(r["turns"][0]) for r in train)


@pytest.mark.parametrize("shape", ["sharegpt", "messages", "spec_bench", "prompt"])
def test_sft_and_distillation_inputs_skip_heldout_questions(shape):
    from training.data import normalize_conversation
    from training.regenerate import conversation

    question = ODD[3]["turns"][0]
    records = {
        "sharegpt": {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "ok"}]},
        "messages": {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "ok"}]},
        "spec_bench": {**ODD[3], "question_id": 2},  # renumbered: the text decides
        "prompt": {"prompt": question},
    }
    record = records[shape]
    assert conversation(record, 0) == (None, "heldout_question")  # regenerate (distillation data)
    if shape in ("sharegpt", "messages"):
        assert normalize_conversation(record) == (None, "heldout_question")  # SFT / distillation training
        assert normalize_conversation(record, evaluation=True)[0] is not None  # agreement on held-out data


def test_prepare_sft_counts_heldout_records_and_keeps_the_rest():
    import datasets

    from mamba_draft.benchmarks.corpus import train_tokenizer
    from training.data import prepare_sft

    tokenizer = train_tokenizer(["hello world question answer"] * 5, vocab_size=100)
    rows = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "an answer"}]}
            for t in (ODD[0]["turns"][0], EVEN[0]["turns"][0], ODD[1]["turns"][0])]
    kept, skipped = prepare_sft(datasets.Dataset.from_list(rows), tokenizer, 2048)
    assert len(kept) == 1 and skipped == {"heldout_question": 2}


def test_tuning_prompt_files_drop_heldout_questions(tmp_path):
    from tree_search.prompts import load_prompts

    assert {p.question_id for p in load_prompts(SPEC_BENCH, split="train")} == {str(r["question_id"]) for r in EVEN}
    assert {p.question_id for p in load_prompts(SPEC_BENCH, split="heldout")} == {str(r["question_id"]) for r in ODD}
    only_odd = tmp_path / "odd.jsonl"
    only_odd.write_text("\n".join(json.dumps({"prompt": r["turns"][0]}) for r in ODD[:3]))
    with pytest.raises(ValueError, match="no train prompts"):
        load_prompts(only_odd, split="train")


def test_autojudge_mining_never_reads_heldout_prompts(tmp_path):
    """`autojudge mine` builds a classifier's training data: odd-id prompts are dropped before any model loads."""
    from mamba_draft.commands import cli

    only_odd = tmp_path / "odd.jsonl"
    only_odd.write_text("\n".join(json.dumps(r) for r in ODD[:4]))
    with pytest.raises(ValueError, match="no train prompts"):
        cli.main(["autojudge", "mine", "--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                  "--prompts", str(only_odd), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ self-contained: nothing outside the repo

OUTSIDE = re.compile(r"\.\./shared|/work/|/shared/data|/home/[a-z]|/root/|/Users/[A-Za-z]|C:\\\\Users")


def test_no_path_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    this = Path(__file__).relative_to(REPO).as_posix()
    texts = [f for f in files if f != this and Path(f).suffix in (".py", ".md", ".sh", ".toml", ".yaml", ".yml",
                                                                    ".json", ".cfg", ".txt", "")]
    assert len(texts) > 50
    hits = [f"{f}:{n}: {line.strip()[:80]}" for f in texts if (REPO / f).is_file()
            for n, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


def test_the_outside_path_check_sees_what_it_must():
    outside = ["..", "shared", "data", "q.jsonl"], ["", "work", "shared", "data", "spec.jsonl"], ["", "root", "cache"]
    for line in ("/".join(parts) for parts in outside):  # joined here, so this file itself holds no such path
        assert OUTSIDE.search(f"SPEC = Path('{line}')"), line
    assert not OUTSIDE.search("benchmarks/data/spec_bench_question.jsonl and a shared prefix cache")


def test_bench_evaluates_on_odd_ids_and_tunes_on_even_ones():
    from mamba_draft.benchmarks.bench import bench_prompts
    from mamba_draft.commands.cli import build_parser

    def ids(*extra):
        args = build_parser("bench").parse_args(["--target", "smollm2", "--out", "unused", *extra])
        return {int(p.question_id) % 2 for p in bench_prompts(args)}

    assert ids() == {1} and ids("--split", "train") == {0} and ids("--split", "all") == {0, 1}
