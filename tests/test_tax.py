"""`mamba-draft tax`: the exactness tax table and the rows table (float and integer products, their slope per row
beside the memory floor and the product peak), on a tiny Llama whose products hold a GGUF's Q4_1 / Q8_0 values."""
import copy
import re

import torch

from mamba_draft.benchmarks import tax
from tests.helpers.drafters import save_tiny_hf_mamba
from tests.test_cpu_step import _model


def test_tax_prints_both_tables_for_a_coded_target(tmp_path, capsys, monkeypatch):
    from mamba_draft.commands.cli import main

    _model("llama", torch.float32, gguf=True).save_pretrained(tmp_path / "target")
    save_tiny_hf_mamba(tmp_path / "drafter", "mamba2", vocab_size=64)  # a Mamba-2 drafter: the compiled step
    monkeypatch.setattr(tax, "FORWARDS", (("step", 1), ("verify", 4), ("prefill", 8)))
    monkeypatch.setattr(tax, "CONTEXT", 8)
    assert main(["tax", "--target", str(tmp_path / "target"), "--dtype", "float32", "--repeats", "1",
                 "--closeness-tokens", "0", "--drafter", str(tmp_path / "drafter")]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith("CPU: ") and line.endswith("dtype float32") for line in out.splitlines())
    assert "| step, 1 token after 8 |" in out
    rows = [line for line in out.split("A drafting level of")[0].splitlines() if re.match(r"\| \d+ \| ", line)]
    assert [int(line.split("|")[1]) for line in rows] == list(tax.ROWS)
    assert rows[0].count("| 1.00x |") == 2  # float and int8, each against its own one-row forward
    products = {line.split("|")[1].strip(): line for line in out.splitlines() if re.match(r"\| (float|int8) \| ", line)}
    assert set(products) == {"float", "int8"}
    floors = {name: float(line.split("|")[3]) for name, line in products.items()}
    assert floors["float"] == floors["int8"]  # both read the GGUF's codes, not floats
    assert re.search(r"A row is \d+ M multiply-adds; this machine reads [\d.]+ GB/s", out)
    assert "| rows | torch ms | compiled ms | speedup |" in out  # the drafter's level over the same rows
    levels = [line for line in out.split("A drafting level of")[1].splitlines() if re.match(r"\| \d+ \| ", line)]
    assert [int(line.split("|")[1]) for line in levels] == list(tax.ROWS)


def test_slope_is_the_least_squares_ms_per_row():
    assert abs(tax.slope({1: 3.0, 2: 4.0, 4: 6.0, 8: 10.0}) - 1.0) < 1e-12


def test_closeness_counts_top1_agreement_with_the_fp32_model():
    from mamba_draft.benchmarks import closeness

    model = _model("llama", torch.float32, gguf=True)
    prompts = [[5, 9, 17, 3], [22, 41, 8, 1, 30]]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    found = closeness.agreement("not-a-gguf", prompts, 12, model, bf16, True)
    assert set(found) == {"bf16 (transformers)", "fp32, our step", "int8 products, our step"}
    assert found["fp32, our step"] >= 0.95  # the fp32 step is transformers' fp32 model up to sum order
    assert all(0.5 < rate <= 1.0 for rate in found.values())
