"""`mamba-draft demo --quick` end to end (corpus -> DeepSpeed training -> export -> benchmark), then from cache."""
from __future__ import annotations

import json

import pytest

from mamba_draft.benchmarks import demo
from mamba_draft.benchmarks.methods import parse_method
from mamba_draft.commands import cli


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    assert cli.main(["demo", "--toy", "--quick", "--cache-dir", str(cache)]) == 0
    (run_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    return cache, run_dir


def test_quick_demo_trains_exports_and_benchmarks(quick_run):
    from transformers import AutoConfig

    from mamba_draft import MambaDrafter

    _, run_dir = quick_run
    assert AutoConfig.from_pretrained(run_dir / "target").model_type == "llama"
    assert AutoConfig.from_pretrained(run_dir / "assistant").model_type == "llama"
    drafter = MambaDrafter.from_pretrained(str(run_dir / "drafter"))
    assert drafter.config.d_model == demo.QUICK.drafter.hidden_size
    assert not (run_dir / "runs" / "target").exists()  # DeepSpeed checkpoints are removed after export

    result = json.loads((run_dir / "results" / "demo.json").read_text())
    methods = result["batches"]["1"]["methods"]
    assert {parse_method(spec).name for spec in demo.DEMO_METHODS} <= set(methods)
    assert methods["cpu-bandit"]["tree"].startswith("bandit-time:")
    assert result["baselines"] == ["ar", "hf-ar"] and result["reference"] == "ar"
    for name, s in methods.items():
        assert all(v > 0 for v in s["tokens_per_s"]), name
        # greedy speculative output must equal our plain decoding on the same model (hf-* run on a plain copy)
        if s["lossless"] and not name.startswith("hf-"):
            assert s["equality"]["all_repeats_identical"], (name, s["equality"])
        else:
            assert 0.0 <= s["equality"]["prefix_agreement"] <= 1.0
    assert methods["chain:5"]["tree"] == "1,1,1,1,1"
    assert set(result["skipped_verifiers"]) == {"sampling", "autojudge"}
    sizing = result["sizing"]  # bare target token vs drafter step, the sizing criterion
    assert sizing["target_token_ms"] > 0 and sizing["drafter_step_ms"] > 0
    assert sizing["ratio"] == pytest.approx(sizing["target_token_ms"] / sizing["drafter_step_ms"])
    assert set(sizing["verify_cost"]) == {"2", "4", "8"} and all(c > 0 for c in sizing["verify_cost"].values())
    md = (run_dir / "results" / "demo.md").read_text()
    assert "| bandit |" in md and "| default |" in md and "speedup vs best of ar/hf-ar" in md
    assert (run_dir / "results" / "demo_speedup.png").read_bytes()[:4] == b"\x89PNG"
    # the held-out prompts never come from files the models were trained on
    train_text = (run_dir / "corpus" / "train.jsonl").read_text()
    for line in (run_dir / "corpus" / "prompts.jsonl").read_text().splitlines():
        assert json.dumps(json.loads(line)["prompt"])[1:-1] not in train_text


def test_rerun_uses_cached_models(quick_run, monkeypatch, tmp_path, capsys):
    import training.train

    cache, run_dir = quick_run

    def no_training(*_, **__):
        raise AssertionError("cached models must not be retrained")

    monkeypatch.setattr(training.train, "train", no_training)
    mtime = (run_dir / "drafter" / "model.safetensors").stat().st_mtime
    assert cli.main(["demo", "--toy", "--quick", "--cache-dir", str(cache)]) == 0  # cached results: just the table
    assert "results cached" in capsys.readouterr().out
    # other measurement settings: measured again without --rebench (the cache key covers the models only)
    default = ["demo", "--toy", "--quick", "--cache-dir", str(cache)]
    for args, measured in ((default + ["--max-new-tokens", "8"], True), (default + ["--max-new-tokens", "8"], False),
                           (default, True)):
        assert cli.main(args) == 0
        printed = capsys.readouterr().out
        assert ("measuring again" in printed) == measured and ("results cached" in printed) != measured, args
    assert json.loads((run_dir / "results" / "demo.json").read_text())["config"]["max_new_tokens"] != 8
    out = tmp_path / "again"
    assert cli.main(default + ["--rebench", "--out", str(out), "--max-new-tokens", "8"]) == 0
    assert json.loads((out / "demo.json").read_text())["config"]["max_new_tokens"] == 8
    assert (run_dir / "drafter" / "model.safetensors").stat().st_mtime == mtime


def test_demo_rejects_bad_arguments(tmp_path):
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        cli.main(["demo", "--toy", "--quick", "--cache-dir", str(not_dir)])
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        cli.main(["demo", "--toy", "--quick", "--cache-dir", str(tmp_path / "c"), "--repeats", "0"])
    assert not (tmp_path / "c").exists()
