"""The real demo's time budget: plain decoding's measured speed projects the tables, and repeats, questions per
category and then questions are cut until the projection fits; the tables and the JSON say what was cut."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import demo
from benchmarks.bench import load_models, markdown_report, resolve_methods
from benchmarks.real_pair import RealPairConfig
from commands import cli
from tests.test_bench import tiny_pair  # noqa: F401  (the same tiny target / drafter)

# Spec-Bench-like records: 3 categories x 4 questions, odd ids held out (the benchmark's), even ids for training
RECORDS = [{"question_id": 4 * c + i + 1, "category": name, "turns": [text]}
           for c, (name, text) in enumerate([("def", "def add(a,"), ("class", "class Point:"), ("loop", "for i in")])
           for i in range(4)]


@pytest.mark.parametrize("seconds_left, cuts, kept", [
    (100, [], (2, 2, 6)),  # 3 decodes x (1 warm-up + 2 repeats x 6 questions) = 39 s fit
    (25, ["repeats 2 -> 1"], (1, 2, 6)),  # 21 s
    (10, ["repeats 2 -> 1", "questions per category 2 -> 1", "questions 6 -> 2"], (1, 1, 2)),  # 9 s
    (0, ["repeats 2 -> 1", "questions per category 2 -> 1", "questions 6 -> 1"], (1, 1, 1)),  # never below one
])
def test_fit_budget_cuts_repeats_then_questions_per_category_then_questions(seconds_left, cuts, kept):
    cfg, repeats, budget = demo.fit_budget(RECORDS, RealPairConfig(per_category=2), 2, decodes=3, decode_s=1.0,
                                           budget_s=600, seconds_left=seconds_left)
    assert budget["cuts"] == cuts and (repeats, cfg.per_category, budget["kept"]["questions"]) == kept
    assert budget["asked"] == {"questions": 6, "per_category": 2, "repeats": 2}
    assert budget["summary"].startswith("Cut to fit the time budget: " + ", ".join(cuts) if cuts else "Within budget")
    assert "1.00 s a question" in budget["summary"] and "10-min budget" in budget["summary"]
    questions = demo.heldout_questions(RECORDS, cfg.per_category, cfg.bench_prompts)
    assert len(questions) == kept[2] and all(int(q.question_id) % 2 == 1 for q in questions)  # held out: odd ids


def test_demo_tables_measure_what_fits_and_say_what_was_cut(tiny_pair, monkeypatch):  # noqa: F811
    """A fake clock and a fake 1-s plain decoding: both tables measure the one question that fits, and each table's
    header and JSON, like the demo's, carry the cut."""
    root, _ = tiny_pair
    tables = {"greedy": resolve_methods(["hf-ar", "ar", "chain:2"]), "sampled": resolve_methods(["ar"])}
    models = load_models([m for methods in tables.values() for m in methods], root / "target", dtype=torch.float32,
                         device="cpu", drafter=root / "drafter")
    assert demo.time_plain_decoding(models, demo.heldout_questions(RECORDS, 1, 2), 3) > 0  # the real probe runs
    monkeypatch.setattr(demo, "time_plain_decoding", lambda models, prompts, max_new_tokens: 1.0)
    cfg = RealPairConfig(per_category=2, max_new_tokens=3)
    # 4 decodes x (1 + 2 x 6) = 52 s asked; 4 x (1 + 1) = 8 s fit the 10 s left
    out = demo.measure_tables(models, RECORDS, cfg, tables, 2, budget_s=10, started=0.0, progress=False,
                              clock=lambda: 0.0)
    expected = ["repeats 2 -> 1", "questions per category 2 -> 1", "questions 6 -> 1"]
    assert out["budget"]["cuts"] == expected and out["budget"]["projected_s"] == 8.0
    for name in ("greedy", "sampled"):
        table = json.loads(json.dumps(out[name]))  # as demo.json stores it
        assert len(table["prompts"]) == 1 and table["config"]["repeats"] == 1
        assert table["budget"]["cuts"] == expected
        assert markdown_report(table).startswith("**Cut to fit the time budget: " + ", ".join(expected))
    assert out["sampled"]["config"]["temperature"] == cfg.temperature


def test_budget_minutes_reaches_the_real_demo_and_is_checked(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "run_real_demo", lambda cfg, *a, **k: seen.append(k["budget_minutes"]) or {})
    monkeypatch.setattr(demo, "print_real", lambda result: None)
    cache = ["--cache-dir", str(tmp_path / "c")]
    assert cli.main(["demo", *cache]) == 0 and cli.main(["demo", "--budget-minutes", "2.5", *cache]) == 0
    assert seen == [demo.BUDGET_MINUTES, 2.5] and demo.BUDGET_MINUTES == 10
    with pytest.raises(ValueError, match="--budget-minutes must be > 0"):
        cli.main(["demo", "--budget-minutes", "0", *cache])
    with pytest.raises(ValueError, match="apply to the real pair"):
        cli.main(["demo", "--toy", "--budget-minutes", "5", *cache])
    assert not (tmp_path / "c").exists()
