"""Real multi-process DeepSpeed runs on CPU (gloo): pretraining, SFT and distillation through the `deepspeed`
launcher, exact resume after SIGKILL under `torchrun`, and export of the ZeRO-1/2/3 checkpoints they write.

Launches are expensive (~15-30 s each on 2 cores), so each is a module-scoped fixture shared by several tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import transformers
from safetensors.torch import load_file

from mamba_draft import MambaDrafter
from tests.helpers.training_fixtures import (FIXTURES, REPO, deepspeed_cmd, free_port, make_tokenizer, read_metrics,
                                             train_env)
from training.config import ModelConfig
from training.export import export
from training.model import load_tokenizer, model_config

pytestmark = pytest.mark.heavy  # minutes of work: scheduled first (tests/conftest.py)

TINY = REPO / "configs" / "tiny"
LAUNCH_TIMEOUT = 240


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def tok_dir(workdir) -> Path:
    return make_tokenizer(workdir / "tokenizer")


@pytest.fixture(scope="module")
def target_dir(workdir, tok_dir) -> Path:
    """A tiny random Llama target sharing the tokenizer (what the demo distils from)."""
    tokenizer = load_tokenizer(str(tok_dir))
    torch.manual_seed(0)
    cfg = model_config(ModelConfig(arch="llama", hidden_size=32, num_hidden_layers=2, num_heads=2), tokenizer)
    out = workdir / "target"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def launch(cmd: list[str], log: Path) -> str:
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(), stdout=f, stderr=subprocess.STDOUT,
                              timeout=LAUNCH_TIMEOUT)
    text = log.read_text()
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{text[-4000:]}"
    return text


def deepspeed_run(workdir, tok_dir, config: str, name: str, extra: list[str] = ()) -> tuple[Path, str]:
    out = workdir / name
    cmd = deepspeed_cmd(2, TINY / config, [f"model.tokenizer={tok_dir}", f"output_dir={out}", *extra])
    return out, launch(cmd, workdir / f"{name}.log")


# Pretraining on the FineWeb-Edu-shaped fixture; also the uninterrupted reference for the resume test.
PRETRAIN = ["steps=8", "checkpoint_every=4"]


@pytest.fixture(scope="module")
def pretrain_run(workdir, tok_dir):
    return deepspeed_run(workdir, tok_dir, "pretrain-cpu.yaml", "pretrain",
                         [f"data.path={FIXTURES / 'fineweb_edu.jsonl'}", *PRETRAIN])


@pytest.fixture(scope="module")
def sft_run(workdir, tok_dir):
    return deepspeed_run(workdir, tok_dir, "sft-cpu.yaml", "sft", [f"data.path={FIXTURES / 'sharegpt.json'}"])


@pytest.fixture(scope="module")
def distill_run(workdir, tok_dir, target_dir):
    return deepspeed_run(workdir, tok_dir, "distill-cpu.yaml", "distill",
                         [f"data.path={FIXTURES / 'sharegpt.json'}", f"distill.target={target_dir}"])


def assert_learns(out: Path, steps: int = 8) -> list[dict]:
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    losses = [m["loss"] for m in metrics]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses
    return metrics


def test_deepspeed_pretrain_two_ranks_loss_decreases(pretrain_run):
    out, log = pretrain_run
    assert "dist_world_size=2" in log  # the stock launcher started two local ranks
    metrics = assert_learns(out)
    assert all(m["tokens"] == 8 * 32 for m in metrics)  # global batch: 8 windows of 32 tokens
    assert metrics[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup step 1 of 2
    assert metrics[-1]["lr"] < metrics[2]["lr"]  # cosine decay
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step8"
    assert (out / "checkpoints" / "global_step4" / "train_state_rank1.pt").is_file()


def test_deepspeed_sft_two_ranks_counts_skipped_and_learns(sft_run):
    out, log = sft_run
    assert "SFT: 12 conversations kept, 6 skipped" in log
    assert "'non_alternating': 2" in log
    assert_learns(out)


def test_deepspeed_distill_two_ranks_kl_decreases(distill_run, target_dir):
    out, _ = distill_run
    assert_learns(out)
    assert "target: " + str(target_dir) in (out / "config.yaml").read_text()


def logits_match(model_dir: Path) -> None:
    ids = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    drafter = MambaDrafter.from_pretrained(model_dir, device="cpu", dtype=torch.float32, backend="torch")
    with torch.no_grad():
        a, b = hf(ids).logits, drafter.forward(ids)
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("run_name,stage", [("sft_run", 1), ("pretrain_run", 2), ("distill_run", 3)])
def test_export_each_zero_stage_loads_in_drafter_and_transformers(request, workdir, run_name, stage):
    out, _ = request.getfixturevalue(run_name)
    assert json.loads((REPO / f"configs/deepspeed/zero{stage}.json").read_text())["zero_optimization"]["stage"] == stage
    assert f"zero{stage}.json" in (out / "config.yaml").read_text()
    hf_dir = export(out, workdir / f"export-zero{stage}")
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf_dir.iterdir()}
    logits_match(hf_dir)
    # the export holds the trained weights, not the initial ones
    trained = load_file(str(hf_dir / "model.safetensors"))
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_dir))
    assert any(not torch.equal(v, fresh.state_dict()[k]) for k, v in trained.items() if k in fresh.state_dict())
    ssm_dir = export(out, workdir / f"export-zero{stage}-ssm", format="mamba_ssm")
    assert (ssm_dir / "pytorch_model.bin").is_file() and "d_model" in json.loads((ssm_dir / "config.json").read_text())
    ids = torch.randint(0, 290, (1, 12))
    a = MambaDrafter.from_pretrained(ssm_dir, backend="torch").forward(ids)
    b = MambaDrafter.from_pretrained(hf_dir, backend="torch").forward(ids)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------- exact resume

def torchrun_cmd(overrides: list[str], resume: bool = False) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "training.train",
            "--config", str(TINY / "pretrain-cpu.yaml"), *overrides, *(["--resume"] if resume else [])]


def wait_for(log: Path, marker: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {marker!r}:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {marker!r}")


def test_resume_after_sigkill_is_exact(workdir, tok_dir, pretrain_run):
    """Steps 1-4 under torchrun, SIGKILL while it hangs after the step-4 checkpoint, resume to 8 under torchrun:
    the same losses and weights as the uninterrupted `deepspeed`-launched run (same config, same 2 ranks)."""
    full, _ = pretrain_run
    common = [f"model.tokenizer={tok_dir}", f"data.path={FIXTURES / 'fineweb_edu.jsonl'}", *PRETRAIN]

    killed = workdir / "resume-killed"
    log = workdir / "resume-killed.log"
    with log.open("w") as f:
        proc = subprocess.Popen(torchrun_cmd([*common, f"output_dir={killed}", "hang_after_step=4"]), cwd=REPO,
                                env=train_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(log, "hang_after_step: checkpoint at step 4 written", proc, LAUNCH_TIMEOUT)
    finally:
        # torchrun starts each rank in its own session, so killing the launcher's group would orphan them:
        # SIGKILL the launcher and every descendant at once; nothing gets to clean up.
        family = [proc.pid] + [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
        for pid in family:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        psutil.wait_procs([psutil.Process(pid) for pid in family[1:] if psutil.pid_exists(pid)], timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert (killed / "checkpoints" / "latest").read_text().strip() == "global_step4"
    assert not (killed / "checkpoints" / "global_step8").exists()

    launch(torchrun_cmd([*common, f"output_dir={killed}"], resume=True), workdir / "resume-resumed.log")
    a, b = read_metrics(full), read_metrics(killed)
    assert [m["step"] for m in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) < 1e-5 and x["lr"] == pytest.approx(y["lr"], abs=1e-12), (x, y)
    wa = load_file(str(export(full, workdir / "resume-full-export") / "model.safetensors"))
    wb = load_file(str(export(killed, workdir / "resume-killed-export") / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=0)
