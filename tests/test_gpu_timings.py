"""mamba_draft/benchmarks/gpu_timings.py (what scripts/gpu_check.sh times on a GPU) runs end to end in its --smoke shapes on
any machine, and its projected speedups are the formula τ · T_target / T_round of its own measurements."""
from __future__ import annotations

import json

import pytest

from mamba_draft.benchmarks.gpu_timings import CHAINS, CHAIN5, PAPER_TAU, TREES, VERIFY_TREES, run_timings, smoke_config, \
    write_outputs
from mamba_draft.commands.cli import main


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    result = run_timings(smoke_config("cpu"), progress=lambda _: None)
    out = tmp_path_factory.mktemp("gpu_timings")
    return result, write_outputs(result, out)


def test_every_section_is_measured(smoke):
    result, _ = smoke
    cfg = result["config"]
    assert {(r["backend"], r["graphs"], r["batch"]) for r in result["drafter_steps"]} == \
        {("torch", False, b) for b in cfg["batches"]}  # CPU: no kernels, no graphs
    assert [tuple(r["tree"]) for r in result["tree_drafting"]] == list(CHAINS + TREES)
    assert next(r["vs_chain5"] for r in result["tree_drafting"] if tuple(r["tree"]) == CHAIN5) == 1.0
    assert all(r["ms"] > 0 for r in result["drafter_steps"] + result["tree_drafting"])
    for entry in result["targets"].values():
        assert {(r["mode"], r["tokens"]) for r in entry["verify"]} == \
            {(m, n) for m in ("dynamic", "static") for n in VERIFY_TREES}
        plain, *trees = entry["batched"]
        for r in trees:
            assert r["projected_speedup"] == pytest.approx(r["tau"] * plain["ms"] / (r["ms"] + r["draft_ms"]))
        assert entry["syncs"]["generate_rounds"] > 0 and entry["syncs"]["generate_syncs"] is None  # no CUDA
        # fp32 on a CPU: exact by construction, every row alone and in the batch, per paper shape
        assert {(tuple(r["tree"]), r["mode"]) for r in entry["identity"]} == \
            {(t, m) for t in PAPER_TAU for m in ("one prompt", f"batch {cfg['identity_prompts']}")}
        assert all(r["identical"] == r["rows"] == cfg["identity_prompts"] and not r["first_difference"]
                   for r in entry["identity"])


def test_projected_speedup_is_tau_times_target_over_round(smoke):
    result, _ = smoke
    rows = result["projected"]
    assert {tuple(r["tree"]) for r in rows} == set(PAPER_TAU)
    for r in rows:
        verify = [v["ms"] for v in result["targets"][r["target"]]["verify"]]
        assert r["target_ms"] in verify and r["verify_ms"] in verify
        assert r["speedup"] == pytest.approx(r["tau"] * r["target_ms"] / (r["draft_ms"] + r["verify_ms"]))


def test_outputs_json_markdown_and_plots(smoke):
    result, paths = smoke
    assert json.loads(paths["json"].read_text())["projected"] == json.loads(json.dumps(result["projected"]))
    text = paths["markdown"].read_text()
    for heading in ("Drafter step", "Tree drafting", "verify + commit", "trees vs plain decoding", "greedy identity",
                    "Projected speedup"):
        assert heading in text
    assert paths["steps_png"].stat().st_size > 0 and paths["verify_png"].stat().st_size > 0


def test_bad_arguments_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MAMBA_DRAFT_DEBUG", raising=False)
    assert main(["gpu-timings", "--smoke", "--device", "cpu", "--targets", "nope", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == \
        "mamba-draft gpu-timings: error: unknown --targets ['nope']; choose from ['tiny-neox']"
    assert main(["gpu-timings", "--smoke", "--device", "cpu", "--iters", "0", "--out", str(tmp_path)]) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_host_syncs_counts_sync_warnings_only(monkeypatch):
    """Each synchronizing op is one site; the debug mode's own notices (also about synchronization) are not."""
    import warnings

    import torch

    from mamba_draft.benchmarks import gpu_timings

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def fn():
        warnings.warn("Synchronization debug mode is a prototype feature")
        warnings.warn(gpu_timings.SYNC_WARNING)
        warnings.warn("an unrelated warning")
        warnings.warn(gpu_timings.SYNC_WARNING)

    sites = gpu_timings.host_syncs(fn)
    assert [site.rsplit(":", 1)[0] for site in sites] == [__file__] * 2  # file:line of each syncing call
    assert modes == ["warn", 0]  # the mode is switched on around fn and restored
