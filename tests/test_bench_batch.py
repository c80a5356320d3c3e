"""`mamba-draft bench --batch-size`: every method decodes the same left-padded batches; per batch size a table
(throughput, speedups vs batched ar / hf-ar, equality with the target's per-prompt greedy output) and line plots."""
from __future__ import annotations

import json

import pytest

from mamba_draft.benchmarks.methods import until_eos
from mamba_draft.commands import cli
from tests.test_bench import tiny_pair  # noqa: F401  (the same tiny target / drafter / 3 prompts)

PNG = b"\x89PNG\r\n\x1a\n"
LOSSLESS = ("hf-ar", "ar", "chain:2", "2,1", "cpu")


def test_batch_sweep_writes_tables_and_plots(tiny_pair, tmp_path):  # noqa: F811
    root, prompts = tiny_pair
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
                     "--prompts", str(prompts), "--batch-size", "1,2", "--repeats", "1", "--max-new-tokens", "10",
                     "--methods", "hf-ar", "ar", "chain:2", "2,1", "cpu=bandit-time:none/1,1/1,1,1",
                     "2,1@fly", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["batch_sizes"] == [1, 2] and list(result["batches"]) == ["1", "2"]
    assert len(result["references"]) == 3  # per prompt: the target's own greedy generate
    prompt_tokens = result["prompt_tokens"]
    assert len(set(prompt_tokens)) > 1  # different lengths: the batches of 2 are really left-padded
    for size, entry in result["batches"].items():
        methods, runs = entry["methods"], entry["runs"]
        for name in LOSSLESS:
            assert methods[name]["lossless"] and methods[name]["equality"]["all_repeats_identical"], (size, name)
        fly = methods["2,1@fly"]
        assert fly["lossless"] is False and "prefix_agreement" in fly["equality"]
        for name, s in methods.items():
            records = runs[name][0]["records"]
            assert len(records) == (3 if size == "1" else 2)  # batches of 2 over 3 prompts: 2 + 1
            assert len(runs[name][0]["outputs"]) == 3
            assert sum(r["new_tokens"] for r in records) == sum(map(len, runs[name][0]["outputs"]))
            # throughput is over all batches: total tokens / total wall time, not a mean of per-batch rates
            total = sum(r["new_tokens"] for r in records) / sum(r["wall_time"] for r in records)
            assert s["tokens_per_s"] == [pytest.approx(total)]
            base = {b: sum(r["new_tokens"] for r in runs[b][0]["records"])
                    / sum(r["wall_time"] for r in runs[b][0]["records"]) for b in ("ar", "hf-ar")}
            assert s["speedup_vs_ar"] == [pytest.approx(total / base["ar"])]
            assert s["speedup_vs_hf-ar"] == [pytest.approx(total / base["hf-ar"])]
            assert s["speedup"] == [pytest.approx(total / max(base.values()))]  # the headline: the faster baseline
        assert methods["ar"]["tau"] == [1.0] and methods["hf-ar"]["tau"] == [1.0]
        assert methods["chain:2"]["tau"][0] >= 1.0
        if size == "2":  # ours went through the batched engine: its rounds serve both rows of a batch
            first = runs["chain:2"][0]["records"][0]
            assert first["batch_rounds"] < first["rounds"]
            assert sum(v["pulls"] for v in methods["cpu"]["arms"].values()) == sum(
                r["batch_rounds"] for r in runs["cpu"][0]["records"])
    md = (out / "bench.md").read_text()
    assert "### Batch size 1" in md and "### Batch size 2" in md and "Tokens/s by batch size" in md
    assert "| chain:2 | greedy |" in md and "**DIFFERS" not in md
    assert "| speedup vs best of ar/hf-ar | vs ar | vs hf-ar |" in md and result["baselines"] == ["ar", "hf-ar"]
    for png in ("bench_batch_speedup.png", "bench_batch_tokens_per_s.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert not (out / "bench_tau.png").exists()  # the per-prompt plots belong to --batch-size 1
    assert not list(out.glob(".*tmp"))  # atomic writes leave no temporaries


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "0"], "argument --batch-size: expected positive integers separated by commas, got '0'"),
    (["--batch-size", "a"], "argument --batch-size: expected positive integers separated by commas, got 'a'"),
    (["--batch-size", "2,2"], "argument --batch-size: a batch size is given twice in '2,2'"),
    (["--batch-size", "1,2", "--methods", "hf-assisted"], "hf-assisted decodes one prompt at a "
     "time (transformers' assisted generation is batch 1 only): drop it or use --batch-size 1"),
    (["--batch-size", "4"], "--batch-size 4 needs at least that many prompts;"),
])
def test_bad_batch_sizes_are_one_line_errors(tiny_pair, tmp_path, capsys, monkeypatch, extra, message):  # noqa: F811
    root, prompts = tiny_pair
    monkeypatch.delenv("MAMBA_DRAFT_DEBUG", raising=False)  # the one-line form users see
    argv = ["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts", str(prompts),
            "--methods", "ar", "--out", str(tmp_path / "o"), *extra]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code in (1, 2) and err.count("\n") == 1 and err.startswith("mamba-draft bench: error: ")
    assert message in err
    assert not (tmp_path / "o").exists()


def test_until_eos_cuts_a_batched_rows_padding():
    assert until_eos([5, 2, 2, 2], [2]) == [5, 2]  # transformers pads a finished row with pad = eos
    assert until_eos([5, 6, 0], [2, 6]) == [5, 6]
    assert until_eos([5, 6], [2]) == [5, 6] and until_eos([5], []) == [5]


@pytest.mark.parametrize("memory", ["call", "pass"])
def test_bandit_memory_call_or_pass(tiny_pair, tmp_path, monkeypatch, memory):  # noqa: F811
    """--bandit-memory pass: one bandit learns over a whole pass (reset once per pass, not per prompt); either way
    each record counts its own call's pulls (a persistent bandit's summary counts every call's)."""
    import itertools

    from tree_search import UCBBandit

    resets, used, tags = [], set(), itertools.count()
    reset, select = UCBBandit.reset, UCBBandit.select

    def tag(bandit) -> int:  # ids are reused once a bandit is freed: tag each object instead
        if "_tag" not in vars(bandit):
            bandit._tag = next(tags)
        return bandit._tag

    monkeypatch.setattr(UCBBandit, "reset", lambda self: (resets.append((tag(self), self.persistent)), reset(self))[1])
    monkeypatch.setattr(UCBBandit, "select", lambda self: (used.add(tag(self)), select(self))[1])
    root, prompts = tiny_pair
    out = tmp_path / "out"
    code = cli.main(["bench", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
                     "--prompts", str(prompts), "--batch-size", "1,2", "--repeats", "1", "--max-new-tokens", "6",
                     "--methods", "ar", "cpu=bandit-time:none/1,1", "--bandit-memory", memory, "--out", str(out)])
    assert code == 0
    resets = [persistent for bandit, persistent in resets if bandit in used]  # not the one that checked the spec
    passes = 2 * 2  # per batch size: the warm-up pass and one repeat
    calls = (1 + 3) + (1 + 2)  # per batch size: the warm-up's first batch, then every batch (3 prompts, batches of 2)
    assert len(resets) == (passes if memory == "pass" else passes + calls)
    assert all(resets) == (memory == "pass")
    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["bandit_memory"] == memory
    for entry in result["batches"].values():
        for record in entry["runs"]["cpu"][0]["records"]:
            assert sum(record["arm_pulls"].values()) == record["batch_rounds" if "batch_rounds" in record else "rounds"]
    assert ("learn over the whole pass" in (out / "bench.md").read_text()) == (memory == "pass")
