"""The real demo's time plan: each method's measured costs per prompt and per token and the greedy replies' lengths
project the tables; repeats, then the slowest baseline's questions are cut until the projection fits, never our
methods' questions; the tables and the JSON say what was cut and the projection beside the real time."""
from __future__ import annotations

import json

import pytest
import torch

from mamba_draft.benchmarks import demo
from mamba_draft.benchmarks.bench import load_models, markdown_report, resolve_methods
from mamba_draft.benchmarks.real_pair import RealPairConfig
from mamba_draft.commands import cli
from tests.test_bench import tiny_pair  # noqa: F401  (the same tiny target / drafter)

# Spec-Bench-like records: 3 categories x 4 questions, odd ids held out (the benchmark's), even ids for training
RECORDS = [{"question_id": 4 * c + i + 1, "category": name, "turns": [text]}
           for c, (name, text) in enumerate([("def", "def add(a,"), ("class", "class Point:"), ("loop", "for i in")])
           for i in range(4)]


def test_questions_take_turns_over_the_categories():
    questions = demo.heldout_questions(RECORDS, 2)
    assert [q.category for q in questions] == ["def", "class", "loop"] * 2  # any leading share spans them
    assert all(int(q.question_id) % 2 == 1 for q in questions)  # held out: odd ids
    assert [q.question_id for q in demo.heldout_questions(RECORDS, 2, limit=4)] == ["1", "5", "9", "3"]


TABLES = {"greedy": resolve_methods(["hf-ar", "llama-cpp", "ar", "default"]),
          "sampled": resolve_methods(["hf-ar", "ar", "default"])}
# seconds per prompt token and per new token (the prompts: one token each): hf-ar the slowest baseline, llama.cpp
# the next
COSTS = {table: {"hf-ar": (0.5, 0.1), "llama-cpp": (0.2, 0.02), "ar": (0.1, 0.01), "default": (0.1, 0.008)}
         for table in TABLES}
del COSTS["sampled"]["llama-cpp"]


@pytest.mark.parametrize("seconds_left, repeats, shares", [
    (1000, 2, {"hf-ar": 4, "llama-cpp": 4}),  # everything fits
    (150, 1, {"hf-ar": 4, "llama-cpp": 4}),  # repeats go first
    (60, 1, {"hf-ar": 2, "llama-cpp": 4}),  # then the slowest baseline's questions
    (20, 1, {"hf-ar": 0, "llama-cpp": 4}),
    (15, 1, {"hf-ar": 0, "llama-cpp": 1}),  # then the next baseline's; ours never
    (1, 1, {"hf-ar": 0, "llama-cpp": 0}),
])
def test_plan_tables_cuts_repeats_then_the_slowest_baselines_questions_never_ours(seconds_left, repeats, shares):
    lengths = [100, 50, 100, 50]
    plan = demo.plan_tables(COSTS, [1] * 4, lengths, TABLES, 2, seconds_left)
    assert plan["repeats"] == repeats
    assert plan["shares"] == {"greedy": shares, "sampled": {"hf-ar": shares["hf-ar"]}}

    def seconds(table, method, k):
        prompt_s, token_s = COSTS[table][method]
        return repeats * sum(prompt_s + token_s * n for n in lengths[:k])

    ours = sum(seconds(t, m, 4) for t in TABLES for m in ("ar", "default"))
    expected = ours + sum(seconds(t, b, k) for t in TABLES for b, k in plan["shares"][t].items())
    assert plan["projected_s"] == pytest.approx(expected)
    assert plan["projected_s"] <= seconds_left or shares == {"hf-ar": 0, "llama-cpp": 0}
    if shares["hf-ar"] == 4 and repeats == 2:
        assert plan["cuts"] == [] and plan["summary"].startswith("Within budget: projected")
    else:
        assert plan["summary"].startswith("Cut to fit the time budget: ")
        assert plan["summary"].endswith("our methods decode every question")
    if 0 < shares["hf-ar"] < 4:
        assert "`hf-ar` (a baseline, 16.0 s a question) on the first 2 of 4 questions" in plan["cuts"]
    if shares["hf-ar"] == 0:
        assert "`hf-ar` (a baseline, 16.0 s a question) not run" in plan["cuts"]


def test_demo_tables_measure_what_fits_and_say_what_was_cut(tiny_pair, monkeypatch):  # noqa: F811
    """A fake clock and fake probed costs: our methods decode every question, the slowest baseline the leading
    share that fits; each table's header and JSON, like the demo's, carry the plan, and the result the projection
    beside the time the tables took."""
    root, _ = tiny_pair
    tables = {"greedy": resolve_methods(["hf-ar", "ar", "chain:2"]), "sampled": resolve_methods(["hf-ar", "ar"])}
    models = load_models([m for methods in tables.values() for m in methods], root / "target", dtype=torch.float32,
                         device="cpu", drafter=root / "drafter")
    cfg = RealPairConfig(per_category=2, max_new_tokens=3)
    probed = demo.probe_costs(models, demo.heldout_questions(RECORDS, 1)[0], tables,
                              {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7}})
    assert set(probed["greedy"]) == {"hf-ar", "ar", "chain:2"}  # the real probe runs
    assert all(p >= 0 and t >= 0 for costs in probed.values() for p, t in costs.values())
    costs = {t: {m.name: (0.0, 1.0 if m.name == "hf-ar" else 0.1) for m in methods} for t, methods in tables.items()}
    monkeypatch.setattr(demo, "probe_costs", lambda *args: costs)
    # replies of 3 tokens: ours 3 x 0.3 s + 3 x 0.3 s + ... = 5.4 s for 6 questions; hf-ar 3 s a question per table
    out = demo.measure_tables(models, RECORDS, cfg, tables, 1, budget_s=20, started=0.0, progress=False,
                              clock=lambda: 0.0)
    assert out["reply_lengths"] == [3] * 6 and out["budget"]["shares"]["greedy"] == {"hf-ar": 2}
    assert out["budget"]["projected_s"] == pytest.approx(5.4 + 2 * 6) and out["budget"]["took_s"] == 0.0
    for name in ("greedy", "sampled"):
        table = json.loads(json.dumps(out[name]))  # as demo.json stores it
        assert len(table["prompts"]) == 6 and table["config"]["shares"] == {"hf-ar": 2}
        runs = table["batches"]["1"]["runs"]
        assert len(runs["hf-ar"][0]["records"]) == 2 and len(runs["ar"][0]["records"]) == 6
        assert markdown_report(table).startswith("**Cut to fit the time budget: `hf-ar` (a baseline, 6.0 s a "
                                                 "question) on the first 2 of 6 questions")
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
