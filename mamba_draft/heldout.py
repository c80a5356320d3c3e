"""Spec-Bench, shipped with the package, and the held-out rule that guards it.

Odd `question_id`s are evaluation prompts: no training, distillation, prompt-synthesis or tuning path may read them.
Every such path asks this module, so the rule holds for any file a user passes: a record is held out when any of its
texts is an odd-id question's turn (whitespace and case folded). In mamba_draft: training and tree_search both use it.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench_question.jsonl"
OVERLAP_WORDS = 8  # a generated prompt sharing this many consecutive words with a held-out question is dropped


def is_heldout(record: dict) -> bool:
    """Spec-Bench's evaluation half: odd question ids."""
    return int(record["question_id"]) % 2 == 1


def read_spec_bench(path: str | Path = SPEC_BENCH) -> list[dict]:
    """Spec-Bench question records (`question_id`, `category`, `turns`); one-line errors for a missing/bad file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass --prompts PATH "
                                "(spec_bench_question.jsonl: question_id, category, turns)")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    bad = [r for r in records if not isinstance(r, dict) or "question_id" not in r or "turns" not in r]
    if bad:
        raise ValueError(f"{path}: {len(bad)} records lack question_id/turns (not a Spec-Bench question file)")
    return records


def normalize(text: str) -> str:
    return " ".join(str(text).split()).casefold()


def _ngrams(text: str) -> set[tuple[str, ...]]:
    """The runs of `OVERLAP_WORDS` consecutive words of `text` (case folded)."""
    words = re.findall(r"\w+", text.casefold())
    return {tuple(words[i:i + OVERLAP_WORDS]) for i in range(len(words) - OVERLAP_WORDS + 1)}


@functools.cache
def heldout_texts() -> frozenset[str]:
    """Every turn of every odd-id question of the shipped Spec-Bench, normalized."""
    return frozenset(normalize(t) for r in read_spec_bench() if is_heldout(r) for t in r["turns"])


@functools.cache
def _heldout_ngrams() -> frozenset[tuple[str, ...]]:
    return frozenset(gram for text in heldout_texts() for gram in _ngrams(text))


def is_heldout_text(text: str) -> bool:
    """True when `text` is (up to whitespace and case) a turn of an odd-id Spec-Bench question."""
    return normalize(text) in heldout_texts()


def overlaps_heldout(text: str) -> bool:
    """True when `text` shares `OVERLAP_WORDS` consecutive words with an odd-id question (or is one): the filter for
    prompts a model writes, which may paraphrase or quote an evaluation question."""
    return is_heldout_text(text) or not _heldout_ngrams().isdisjoint(_ngrams(text))
