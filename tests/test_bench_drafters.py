"""`mamba-draft bench-drafters` on tiny random drafters: outputs, matched sizes, memory accounting."""
from __future__ import annotations

import json

import pytest

from mamba_draft.commands import cli


def test_bench_drafters_writes_report(tmp_path):
    out = tmp_path / "bd"
    assert cli.main(["bench-drafters", "--contexts", "128", "512", "--d-model", "64", "--n-layer", "2",
                     "--vocab-size", "256", "--steps", "3", "--warmup", "1", "--device", "cpu", "--out", str(out)]) == 0
    result = json.loads((out / "bench_drafters.json").read_text())
    mamba, llama = result["models"]["Mamba (mamba1)"], result["models"]["Transformer (Llama)"]
    assert [r["context"] for r in mamba["rows"]] == [64, 128, 512]  # the ratio's reference context is added
    assert 0.5 < llama["params"] / mamba["params"] < 2.0            # similar parameter counts
    # the recurrent state has a fixed size; the KV cache grows with the context (2 layers' K and V, fp32)
    assert len({r["cache_bytes"] for r in mamba["rows"]}) == 1
    cache = [r["cache_bytes"] for r in llama["rows"]]
    assert cache[2] > 3 * cache[1] > 3 * cache[0]
    assert all(r["ratio_to_64"] > 0 for r in mamba["rows"] + llama["rows"])
    assert mamba["rows"][0]["ratio_to_64"] == 1.0
    assert "| Mamba (mamba1) |" in (out / "bench_drafters.md").read_text()
    for png in ("bench_drafters_latency.png", "bench_drafters_memory.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_drafters_rejects_bad_contexts(tmp_path):
    with pytest.raises(ValueError, match="--contexts must be positive"):
        cli.main(["bench-drafters", "--contexts", "0", "--out", str(tmp_path)])
