"""Export from in-process (world of one) runs: Mamba-2 drafters and Llama targets, CLI, and bad input.

The ZeRO-1/2/3 exports of real 2-rank runs are in test_train_deepspeed.py (they share its launches).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from mamba_draft import MambaDrafter
from mamba_draft.commands.cli import main as cli
from tests.helpers.training_fixtures import FIXTURES, REPO, make_tokenizer
from training.config import load_config
from training.export import export
from training.train import train


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def run(tok_dir, out, *extra):
    cfg = load_config(REPO / "configs/tiny/pretrain-cpu.yaml",
                      [f"model.tokenizer={tok_dir}", f"output_dir={out}", f"data.path={FIXTURES / 'fineweb_edu.jsonl'}",
                       "steps=2", "deepspeed=configs/deepspeed/zero1.json", *extra])
    return train(cfg)


@pytest.fixture(scope="module")
def mamba2_run(tok_dir, tmp_path_factory):
    return run(tok_dir, tmp_path_factory.mktemp("m2") / "run", "model.arch=mamba2", "model.head_dim=16",
               "model.state_size=8")


@pytest.fixture(scope="module")
def llama_run(tok_dir, tmp_path_factory):
    return run(tok_dir, tmp_path_factory.mktemp("llama") / "run", "model.arch=llama", "model.num_heads=2")


def test_mamba2_export_loads_in_drafter_and_transformers(mamba2_run, tmp_path):
    hf_dir = export(mamba2_run / "checkpoints", tmp_path / "hf")  # the checkpoints/ dir works too
    ids = torch.randint(0, 290, (2, 20), generator=torch.Generator().manual_seed(1))
    hf = transformers.Mamba2ForCausalLM.from_pretrained(hf_dir).eval()
    drafter = MambaDrafter.from_pretrained(hf_dir, backend="torch")
    assert drafter.config.arch == "mamba2"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, drafter.forward(ids), atol=1e-5, rtol=1e-5)
    assert cli(["export", str(mamba2_run), str(tmp_path / "ssm"), "--format", "mamba_ssm"]) == 0
    torch.testing.assert_close(MambaDrafter.from_pretrained(tmp_path / "ssm", backend="torch").forward(ids),
                               drafter.forward(ids), atol=0, rtol=0)


def test_llama_target_export_and_init_from(llama_run, tok_dir, tmp_path):
    hf_dir = export(llama_run, tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.config.model_type == "llama"
    with pytest.raises(ValueError, match="mamba_ssm needs a Mamba model, this checkpoint is 'llama'"):
        export(llama_run, tmp_path / "llama-ssm", format="mamba_ssm")
    # SFT-style continuation from an exported checkpoint starts from exactly those weights
    cont = run(tok_dir, tmp_path / "cont", f"model.init_from={hf_dir}", "optim.lr=0", "optim.weight_decay=0",
               "steps=1")
    again = transformers.AutoModelForCausalLM.from_pretrained(export(cont, tmp_path / "cont-hf"))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_export_bad_input(mamba2_run, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no 'latest' file in .*empty"):
        export(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        export(mamba2_run, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(ValueError, match="unknown export format 'gguf'"):
        export(mamba2_run, tmp_path / "out", format="gguf")
    assert not (tmp_path / "out").exists()


def test_a_llama_trains_on_a_draft_vocabulary_and_exports_the_full_model(tok_dir, tmp_path):
    """model.draft_vocab_size on a Transformer: logits cover the draft ids only in training, the export is the
    ordinary full-vocabulary model (plain transformers) with the id map beside it, which TransformerDrafter reads."""
    from mamba_draft.transformer import TransformerDrafter
    from training.model import build_model, load_tokenizer

    cfg = load_config(REPO / "configs/tiny/pretrain-cpu.yaml", [f"model.tokenizer={tok_dir}", "model.arch=llama",
                                                                "model.num_heads=2"])
    draft = torch.tensor([5, 3, 40, 7])
    model = build_model(cfg.model, load_tokenizer(str(tok_dir)), 0, draft)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 4)
    out = run(tok_dir, tmp_path / "run", "model.arch=llama", "model.num_heads=2", "model.draft_vocab_size=16")
    hf_dir = export(out, tmp_path / "hf")
    full = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    drafter = TransformerDrafter.from_pretrained(str(hf_dir))
    assert drafter.draft_ids.numel() == 16 and full.config.vocab_size > 16
    ids = torch.randint(0, 290, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(drafter(ids), full(ids).logits[..., drafter.draft_ids], atol=1e-5, rtol=1e-5)
