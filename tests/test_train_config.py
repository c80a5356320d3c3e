"""TrainConfig loading (strict YAML + overrides), shipped configs, schedule, and bad-input errors of training."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mamba_draft.commands import cli
from tests.helpers.training_fixtures import FIXTURES, REPO, make_tokenizer
from training.config import ConfigError, TrainConfig, load_config
from training.distributed import deepspeed_config
from training.train import lr_lambda, main, train

TINY = REPO / "configs" / "tiny"
SHIPPED = sorted((REPO / "configs").glob("*/*.yaml"))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny(tok_dir, tmp_path, *extra) -> TrainConfig:
    return load_config(TINY / "pretrain-cpu.yaml", [f"model.tokenizer={tok_dir}", f"output_dir={tmp_path / 'run'}",
                                                    f"data.path={FIXTURES / 'fineweb_edu.jsonl'}", *extra])


def test_overrides_and_types():
    cfg = load_config(TINY / "pretrain-cpu.yaml", ["optim.lr=1e-4", "optim.betas=[0.8, 0.9]", "model.arch=mamba2",
                                                   "steps=3", "distill.target=/x", "optim.warmup_steps=0"])
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.8, 0.9) and cfg.model.arch == "mamba2"
    assert cfg.steps == 3 and cfg.distill.target == "/x" and cfg.model.hidden_size == 32
    assert isinstance(load_config(None, ["optim.lr=1"]).optim.lr, float)


@pytest.mark.parametrize("overrides,match", [
    (["optim.learning_rate=1e-3"], r"unknown config key\(s\) optim.learning_rate"),
    (["nonsense=1"], r"unknown config key\(s\) nonsense"),
    (["steps=many"], r"steps: expected int, got 'many'"),
    (["optim.betas=[0.9]"], r"optim.betas: expected a list of 2 values"),
    (["model=3"], r"model: expected a mapping"),
    (["steps"], r"not of the form key=value"),
])
def test_bad_config_is_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY / "pretrain-cpu.yaml", overrides)


def test_unknown_key_in_yaml_file(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  arch: mamba1\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match=r"model.n_layers.*valid keys in model."):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_configs_load(path):
    cfg = load_config(path)
    world = 8 if cfg.global_batch_size % (8 * cfg.micro_batch_size) == 0 else 2  # paper configs: 8 GPUs
    ds = deepspeed_config(cfg, world=world)
    assert ds["zero_optimization"]["stage"] in (1, 2, 3) and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["train_batch_size"] == cfg.global_batch_size


def test_the_target_aware_recipe_is_the_external_drafter_reading_the_target():
    from training.config import to_dict

    external = to_dict(load_config(REPO / "configs/distill/smollm2-engine.yaml"))
    aware = to_dict(load_config(REPO / "configs/distill/smollm2-target-aware.yaml"))
    assert (aware["model"]["target_hidden_size"], aware["distill"]["draft_windows"], aware["distill"]["window_rate"],
            aware["data"]["path"], aware["eval"]["data"]) == (576, 5, 0.15, "data", "data")
    assert aware["model"]["init_from"] == "runs/smollm2-external"  # `mamba-draft convert smollm2-external ...`
    assert aware["model"]["draft_vocab"] == "runs/smollm2-external/draft_vocab.safetensors"
    shape = ("arch", "hidden_size", "num_hidden_layers", "state_size", "expand", "head_dim", "conv_kernel",
             "tie_word_embeddings", "init_embeddings_from", "freeze_embeddings")
    assert {k: aware["model"][k] for k in shape} == {k: external["model"][k] for k in shape}
    assert aware["distill"]["kl_weight"] == external["distill"]["kl_weight"] and aware["distill"]["ce_weight"] == 0


def test_paper_configs_match_appendix_a3():
    pre = load_config(REPO / "configs/pretrain/mamba-130m-fineweb-edu.yaml")
    assert (pre.steps, pre.global_batch_size, pre.data.seq_len) == (5000, 4096, 2048)
    assert pre.data.path == "HuggingFaceFW/fineweb-edu" and pre.data.streaming
    assert (pre.model.hidden_size, pre.model.num_hidden_layers) == (768, 24)
    sft = load_config(REPO / "configs/sft/mamba-130m-sharegpt.yaml")
    assert (sft.epochs, sft.global_batch_size, sft.data.seq_len, sft.data.kind) == (2, 128, 2048, "sft")
    assert sft.model.init_from and sft.optim.warmup_ratio == 0.1  # SFT starts from the pretrained export
    for ds in ("zero1", "zero2", "zero3"):
        assert json.loads((REPO / f"configs/deepspeed/{ds}.json").read_text())["bf16"]["enabled"] is True


def test_cosine_schedule():
    f = lr_lambda(warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_batch_must_divide():
    cfg = load_config(TINY / "pretrain-cpu.yaml", ["global_batch_size=6", "micro_batch_size=4"])
    with pytest.raises(ValueError, match="global_batch_size 6 is not a multiple of micro_batch_size 4 x world size 1"):
        deepspeed_config(cfg, world=1)


def test_bad_training_inputs_fail_before_writing(tok_dir, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="data.path .*missing.jsonl' matches no file"):
        train(tiny(tok_dir, tmp_path, f"data.path={tmp_path / 'missing.jsonl'}"))
    with pytest.raises(ValueError, match="column named 'body'.*columns"):
        train(tiny(tok_dir, tmp_path, "data.text_column=body"))
    with pytest.raises(ValueError, match="tokenizer has 300 tokens but model vocab_size is 64"):
        train(tiny(tok_dir, tmp_path, "model.vocab_size=64"))
    with pytest.raises(FileNotFoundError, match="--resume: no 'latest' file"):
        train(tiny(tok_dir, tmp_path), resume_run=True)
    with pytest.raises(ValueError, match="model.arch must be mamba1, mamba2 or llama"):
        train(tiny(tok_dir, tmp_path, "model.arch=rwkv"))
    assert not out.exists()  # nothing half-written


def test_in_process_run_then_refuses_to_overwrite(tok_dir, tmp_path):
    """A single plain process (no launcher): train() sets up its own world of one."""
    cfg = tiny(tok_dir, tmp_path, "steps=2", "checkpoint_every=1", "deepspeed=configs/deepspeed/zero1.json")
    out = train(cfg)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "checkpoints/latest").read_text().strip() == "global_step2"
    assert (out / "model/config.json").is_file() and (out / "model/tokenizer.json").is_file()
    with pytest.raises(FileExistsError, match="already holds checkpoints: pass --resume"):
        train(cfg)
    # resuming a finished run is a no-op that keeps the log (`mamba-draft train CONFIG [key=value ...]`, whose
    # teardown ends the process group: once per process)
    assert cli.main(["train", str(TINY / "pretrain-cpu.yaml"), f"model.tokenizer={tok_dir}", f"output_dir={out}",
                     f"data.path={FIXTURES / 'fineweb_edu.jsonl'}", "steps=2", "checkpoint_every=1",
                     "deepspeed=configs/deepspeed/zero1.json", "--resume"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_train_command_reads_config_and_overrides(monkeypatch):
    """`mamba-draft train CONFIG key=value ... [--resume]` runs training.train's main on one process; the launchers'
    form (`--config CONFIG`) is the same command; the help says how DeepSpeed launches it."""
    import training.train

    seen = []
    monkeypatch.setattr(training.train, "train", lambda cfg, resume_run=False: seen.append((cfg, resume_run)))
    config = str(TINY / "pretrain-cpu.yaml")
    assert cli.main(["train", config, "steps=3", "optim.lr=1e-4", "--resume"]) == 0
    assert (seen[-1][0].steps, seen[-1][0].optim.lr, seen[-1][1]) == (3, 1e-4, True)
    assert main(["--config", config, "steps=4", "optim.lr=2e-4"]) == 0
    assert (seen[-1][0].steps, seen[-1][0].optim.lr, seen[-1][1]) == (4, 2e-4, False)
    with pytest.raises(ValueError, match="no CONFIG given"):
        cli.main(["train", "--resume"])
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) nonsense"):
        cli.main(["train", config, "nonsense=1"])
    assert len(seen) == 2
    assert "deepspeed --num_gpus 2 --module training.train CONFIG" in cli.build_parser("train").format_help()
