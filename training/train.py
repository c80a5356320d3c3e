"""Train a drafter (Mamba, or a small Llama: a Transformer drafter or a toy target) with DeepSpeed: pretraining,
SFT or distillation.

    mamba-draft train configs/tiny/pretrain-cpu.yaml [key=value ...] [--resume]      one process
    deepspeed --num_gpus 2 --module training.train CONFIG [key=value ...] [--resume]   several (DeepSpeed's launcher)
    torchrun --nproc_per_node 2 -m training.train CONFIG [key=value ...] [--resume]    several (torch's launcher)

`python -m training.train` is the same command; the launchers run it once per process. CONFIG may also be given as
`--config CONFIG`.

Output directory layout:
    config.yaml          the resolved TrainConfig
    model/               HF config + tokenizer files (weights come from a checkpoint via `mamba-draft export`)
    checkpoints/         DeepSpeed checkpoints (`latest`, global_stepN/ incl. train_state_rank{r}.pt)
    metrics.jsonl        one record per logged step (and per held-out evaluation: heldout_*, train_tokens)
    agreement.png        held-out agreement with the target vs training tokens (with eval.every > 0)
"""
from __future__ import annotations

import argparse
import atexit
import glob
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import datasets
import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch.optim.lr_scheduler import LambdaLR
from safetensors.torch import save_file
from tqdm import tqdm

from mamba_draft.checkpoint import DRAFT_VOCAB, read_draft_ids
from mamba_draft.config import DRAFTED_FEATURES
from mamba_draft.io import atomic_directory
from training import data as data_lib
from training.agreement import HeldoutEval, check_eval_config, plot_agreement
from training.config import TrainConfig, load_config, save_config
from training.distributed import deepspeed_config, init_distributed, use_bf16
from training.engine_data import PackedEngine, check_hidden_width, load_engine
from training.export import FROZEN_WEIGHTS
from training.loss import cached_kl, cross_entropy, feature_loss, forward_kl
from training.model import build_model, frequency_ranked_vocab, frozen_target, load_tokenizer, weight_decay_groups
from training.target_features import known_rows, window_generator, window_mask


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup, then cosine from 1 down to `min_ratio` (lingua's schedule), as a LambdaLR multiplier."""
    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + 0.5 * (1 - min_ratio) * (1 + math.cos(math.pi * progress))
    return multiplier


def build_data(cfg: TrainConfig, tokenizer, rank: int, world: int):
    """The rank's data iterator, the number of records (None when streaming) and the draft vocabulary (or None)."""
    if cfg.data.kind == "engine":
        # the target states read by the drafter and/or matched by the feature loss (validate: the same width)
        width = cfg.model.target_hidden_size or (cfg.model.hidden_size if cfg.distill.feature_weight else None)
        examples = load_engine(cfg.data.path, tokenizer, split="train", hidden_size=width)  # held-out: eval
        if rank == 0:
            print(f"engine: {len(examples)} replies, {sum(e.input_ids.numel() for e in examples)} tokens")
        labels = (e.labels[e.labels != data_lib.IGNORE_INDEX].tolist() for e in examples)
        return (PackedEngine(examples, cfg.data.seq_len, cfg.data.seed, rank, world), len(examples),
                draft_vocab(cfg, tokenizer, labels))
    records = data_lib.load_records(cfg.data)
    if cfg.data.kind == "pretrain":
        n = None if isinstance(records, datasets.IterableDataset) else len(records)
        if cfg.model.draft_vocab_size and n is None:
            raise ValueError("model.draft_vocab_size counts the training data, which a stream cannot give; "
                             "pass model.draft_vocab (a draft_vocab.safetensors file) instead")
        counted = (tokenizer(r[cfg.data.text_column])["input_ids"] for r in records) if n else ()
        return data_lib.PackedSequences(records, tokenizer, cfg.data, rank, world), n, draft_vocab(cfg, tokenizer, counted)
    examples, skipped = data_lib.prepare_sft(records, tokenizer, cfg.data.seq_len)  # sft (`validate` checks kind)
    if rank == 0:
        print(f"SFT: {len(examples)} conversations kept, {sum(skipped.values())} skipped {dict(skipped)}")
    draft_ids = draft_vocab(cfg, tokenizer, (e["labels"] for e in examples))  # what the drafter must predict
    return data_lib.SFTExamples(examples, tokenizer.pad_token_id, cfg.data.seed, rank, world), len(examples), draft_ids


def draft_vocab(cfg: TrainConfig, tokenizer, token_lists) -> torch.Tensor | None:
    """model.draft_vocab (a file) or the model.draft_vocab_size most frequent ids of the training data (with EOS)."""
    if cfg.model.draft_vocab:
        ids = read_draft_ids(cfg.model.draft_vocab)
        if ids is None:
            raise FileNotFoundError(f"model.draft_vocab {cfg.model.draft_vocab!r}: no {DRAFT_VOCAB} there")
        return ids
    if not cfg.model.draft_vocab_size:
        return None
    return frequency_ranked_vocab(token_lists, cfg.model.draft_vocab_size, always=(tokenizer.eos_token_id,),
                                  vocab=len(tokenizer))


def total_steps(cfg: TrainConfig, n_records: int | None) -> int:
    if cfg.steps > 0:
        return cfg.steps
    if cfg.epochs <= 0 or n_records is None:
        raise ValueError("set steps > 0 (or epochs > 0 for a finite dataset)")
    return max(1, math.ceil(cfg.epochs * n_records / cfg.global_batch_size))


def compute_loss(engine, target, batch: dict, cfg: TrainConfig, vocab: int, draft_ids: torch.Tensor | None = None,
                 to_draft: torch.Tensor | None = None) -> torch.Tensor:
    """CE and/or forward KL to the target. With a draft vocabulary the drafter's logits cover `draft_ids` only:
    labels map to draft columns (ids outside it are not scored) and the target's distribution is renormalised
    over the subset (q is zero outside it, so that is the KL the drafter can reach). A drafter that reads the target
    is fed the cached target states on reply rows outside its draft windows (`training.target_features`)."""
    reads = {}
    if cfg.model.target_hidden_size:
        reads = {"features": batch["hidden"], "known": known_rows(batch["labels"], batch.get("windows"))}
        if cfg.model.drafted_features == "own" and "windows" in batch:
            reads["own"] = batch["windows"]
    out = engine(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), **reads)
    logits, labels = out.logits, batch["labels"]
    if draft_ids is not None:
        labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], labels)
        vocab = draft_ids.numel()
    d = cfg.distill
    if "soft_ids" in batch:  # the data engine's cached target distribution: no target forward
        loss = d.kl_weight * cached_kl(logits, batch["soft_ids"], batch["soft_logp"], labels, to_draft)
        if d.feature_weight:
            loss = loss + d.feature_weight * feature_loss(out.hidden_states[-1], batch["hidden"], labels)
    elif target is None:
        return cross_entropy(logits, labels)
    else:
        with torch.no_grad():
            target_logits = target(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
            if draft_ids is not None:
                target_logits = target_logits.index_select(-1, draft_ids)
        loss = d.kl_weight * forward_kl(logits, target_logits, labels, vocab, d.temperature)
    return loss + d.ce_weight * cross_entropy(logits, labels) if d.ce_weight else loss


def write_model_dir(model, tokenizer, out: Path) -> None:
    """HF config + tokenizer (+ draft vocabulary) next to the checkpoints, so export needs only the output dir."""
    if out.exists():
        return
    with atomic_directory(out) as tmp:
        getattr(model, "hf_config", model.config).save_pretrained(tmp)
        if getattr(model, "draft_ids", None) is not None:
            save_file({"d2t": model.draft_ids.cpu()}, str(tmp / DRAFT_VOCAB))
        frozen = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if not p.requires_grad}
        if frozen:  # DeepSpeed's fp32 consolidation covers trained parameters only; frozen ones never change
            save_file(frozen, str(tmp / FROZEN_WEIGHTS))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def save_checkpoint(engine, ckpt_dir: Path, step: int, data, rank: int, train_tokens: int = 0) -> None:
    """Per-rank train state (data position, RNG) first, then DeepSpeed writes `latest` last."""
    tag = f"global_step{step}"
    (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "data": data.state_dict(), "rng": torch.get_rng_state(), "train_tokens": train_tokens},
               ckpt_dir / tag / f"train_state_rank{rank}.pt")
    engine.save_checkpoint(str(ckpt_dir), tag=tag)
    torch.distributed.barrier()


def resume(engine, ckpt_dir: Path, data, rank: int, world: int) -> tuple[int, int]:
    """(step, cumulative training tokens) of the checkpoint, with weights, optimizer, data position and RNG loaded."""
    tag = (ckpt_dir / "latest").read_text().strip()
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} in {ckpt_dir}")
    state_file = ckpt_dir / tag / f"train_state_rank{rank}.pt"
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} missing: was the checkpoint written by {world} ranks?")
    state = torch.load(state_file, weights_only=True)
    data.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"])
    return state["step"], state.get("train_tokens", 0)


def validate(cfg: TrainConfig) -> None:
    """Cheap checks before any process group, model or data work."""
    m, d = cfg.model, cfg.distill
    if not cfg.output_dir:
        raise ValueError("output_dir is empty")
    if cfg.micro_batch_size < 1 or cfg.global_batch_size < 1:
        raise ValueError("micro_batch_size and global_batch_size must be >= 1")
    if cfg.data.kind not in ("pretrain", "sft", "engine"):
        raise ValueError(f"data.kind must be pretrain, sft or engine, got {cfg.data.kind!r}")
    if cfg.data.path and data_lib.is_local(cfg.data.path) and not glob.glob(str(Path(cfg.data.path).expanduser())):
        raise FileNotFoundError(f"data.path {cfg.data.path!r} matches no file")
    if m.init_from and data_lib.is_local(m.init_from) and not Path(m.init_from).exists():
        raise FileNotFoundError(f"model.init_from {m.init_from!r} does not exist")
    if d.feature_weight and cfg.data.kind != "engine":
        raise ValueError("distill.feature_weight needs data.kind: engine (the target's hidden states cached by "
                         "make-data --hidden)")
    if d.feature_weight and m.arch == "llama":
        raise ValueError("distill.feature_weight trains a Mamba drafter's final state, not a Llama's")
    use_bf16(cfg.precision)
    check_eval_config(cfg)
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ImportError("tensorboard: true needs the tensorboard package (pip install tensorboard)")
    # a drafter that reads the target: a Mamba drafter on engine data whose cached hidden states are that wide
    if m.target_hidden_size < 0:
        raise ValueError(f"model.target_hidden_size must be >= 0 (0: token ids only), got {m.target_hidden_size}")
    if d.draft_windows < 0 or d.draft_windows == 1:
        raise ValueError(f"distill.draft_windows must be 0 (off) or K >= 2 (windows of 1..K-1 positions), got "
                         f"{d.draft_windows}")
    if not 0.0 <= d.window_rate <= 1.0:
        raise ValueError(f"distill.window_rate must lie in [0, 1], got {d.window_rate}")
    if m.drafted_features not in DRAFTED_FEATURES:
        raise ValueError(f"model.drafted_features must be one of {DRAFTED_FEATURES}, got {m.drafted_features!r}")
    if m.drafted_features == "own" and not (d.feature_weight and d.draft_windows and m.target_hidden_size):
        raise ValueError("model.drafted_features 'own' feeds drafted tokens the drafter's own state, trained toward "
                         "the target's: it needs model.target_hidden_size, distill.feature_weight > 0 and "
                         "distill.draft_windows")
    if d.draft_windows and not m.target_hidden_size:
        raise ValueError("distill.draft_windows simulates drafted tokens read without a target state: it needs "
                         "model.target_hidden_size > 0 (a drafter that reads the target)")
    if not m.target_hidden_size:
        return
    if m.arch not in ("mamba1", "mamba2"):
        raise ValueError(f"model.target_hidden_size needs a Mamba drafter (model.arch mamba1 or mamba2), got "
                         f"{m.arch!r}")
    if cfg.data.kind != "engine":
        raise ValueError("model.target_hidden_size needs data.kind: engine (a make-data directory with the "
                         "target's hidden states, make-data --hidden)")
    if d.feature_weight and m.hidden_size != m.target_hidden_size:
        raise ValueError(f"distill.feature_weight matches the drafter's state to the target's: model.hidden_size "
                         f"{m.hidden_size} must equal model.target_hidden_size {m.target_hidden_size}")
    eval_dir = [cfg.eval.data] if cfg.eval.data and Path(cfg.eval.data).is_dir() else []
    for path in dict.fromkeys([cfg.data.path] + eval_dir):
        check_hidden_width(path, m.target_hidden_size, "model.target_hidden_size")


def train(cfg: TrainConfig, resume_run: bool = False) -> Path:
    """Run (or resume) training; returns the output directory. Works under any launcher or in-process."""
    validate(cfg)
    out = Path(cfg.output_dir)
    ckpt_dir, metrics_path = out / "checkpoints", out / "metrics.jsonl"
    if resume_run and not (ckpt_dir / "latest").is_file():
        raise FileNotFoundError(f"--resume: no 'latest' file in {ckpt_dir}; nothing to resume from")
    if not resume_run and (ckpt_dir / "latest").is_file():
        raise FileExistsError(f"{cfg.output_dir} already holds checkpoints: pass --resume or use a new output_dir")
    rank, world = init_distributed(cfg.build_shm_comm)
    ds_config = deepspeed_config(cfg, world)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    data, n_records, draft_ids = build_data(cfg, tokenizer, rank, world)
    steps = total_steps(cfg, n_records)
    model = build_model(cfg.model, tokenizer, cfg.seed, draft_ids)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
    target = frozen_target(cfg.distill.target, "distill.target", tokenizer, get_accelerator().current_device_name(),
                           dtype) if cfg.distill.target else None
    warmup = cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * steps)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=weight_decay_groups(model, cfg.optim.weight_decay), config=ds_config,
        lr_scheduler=lambda opt: LambdaLR(opt, lr_lambda(warmup, steps, cfg.optim.lr_min_ratio)))
    torch.manual_seed(cfg.seed + rank)

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        write_model_dir(model, tokenizer, out / "model")
    start, train_tokens = resume(engine, ckpt_dir, data, rank, world) if resume_run else (0, 0)
    if rank == 0 and resume_run and metrics_path.is_file():  # records after the checkpoint: a lost timeline
        kept = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= start]
        metrics_path.write_text("".join(line + "\n" for line in kept))
    heldout = HeldoutEval(cfg, tokenizer, rank, world, engine.device, dtype, target) if cfg.eval.every else None
    heldout_postfix, writer = {}, None
    if cfg.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
        writer = SummaryWriter(str(out / "tensorboard"))

    gas = ds_config["gradient_accumulation_steps"]
    vocab = len(tokenizer)
    to_draft = None
    if draft_ids is not None:
        draft_ids = draft_ids.to(engine.device)
        to_draft = data_lib.draft_label_map(draft_ids, vocab, engine.device)
    windows = bool(cfg.model.target_hidden_size and cfg.distill.draft_windows)
    bar = tqdm(total=steps, initial=start, desc="train", disable=rank != 0, dynamic_ncols=True)
    for step in range(start + 1, steps + 1):
        t0, loss_sum, tokens = time.perf_counter(), torch.zeros((), device=engine.device), 0
        lr = scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler advances inside engine.step)
        for micro in range(gas):
            batch = data.next_batch(cfg.micro_batch_size)  # built on the host: counting tokens costs no sync
            if windows:  # seeded by the step, not the RNG's history: a resumed run draws the same windows
                batch["windows"] = window_mask(batch["labels"] != data_lib.IGNORE_INDEX, cfg.distill.draft_windows,
                                               cfg.distill.window_rate, window_generator(cfg.seed, rank, step, micro))
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = compute_loss(engine, target, batch, cfg, vocab, draft_ids, to_draft)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach()
        stats = torch.tensor([loss_sum.item() / gas, tokens], dtype=torch.float64)
        torch.distributed.all_reduce(stats)
        record = {"step": step, "loss": stats[0].item() / world, "lr": lr,
                  "tokens": int(stats[1]), "tokens_per_s": stats[1].item() / (time.perf_counter() - t0),
                  "grad_norm": float(engine.get_global_grad_norm() or 0.0)}
        train_tokens += int(stats[1])
        if heldout is not None and (step % cfg.eval.every == 0 or step == steps):  # a collective: every rank
            record.update(train_tokens=train_tokens, **heldout(engine))
            heldout_postfix = {"agree": f"{record['heldout_agreement']:.3f}"}
        if rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{record['lr']:.2e}",
                            **heldout_postfix)
            if step % cfg.log_every == 0 or step == steps or "heldout_agreement" in record:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if writer is not None:
                    for key in ("loss", "lr", "tokens_per_s", "grad_norm"):
                        writer.add_scalar(f"train/{key}", record[key], step)
        if step % cfg.checkpoint_every == 0 or step == steps:
            save_checkpoint(engine, ckpt_dir, step, data, rank, train_tokens)
        if cfg.hang_after_step == step:
            print(f"hang_after_step: checkpoint at step {step} written; blocking", flush=True)
            parent = os.getppid()
            while os.getppid() == parent:  # block until killed; never outlive the launcher as an orphan
                time.sleep(1)
            raise SystemExit(f"hang_after_step: launcher {parent} went away")
    bar.close()
    if heldout is not None and rank == 0:
        plot_agreement(metrics_path, out / "agreement.png")
    if writer is not None:
        writer.close()
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`mamba-draft train` / `python -m training.train`: CONFIG [key=value ...] [--resume]."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="YAML file of TrainConfig fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides of CONFIG's fields, e.g. optim.lr=1e-3 data.seq_len=512")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="CONFIG as an option")
    parser.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoints/latest")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")


def run(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if args.config_option is not None:  # `--config FILE a=1 b=2`: argparse read a=1 as the positional CONFIG
        config, overrides = args.config_option, ([config] if config is not None else []) + overrides
    if config is None:
        raise ValueError("no CONFIG given: train CONFIG [key=value ...] (a YAML file of TrainConfig fields)")
    train(load_config(config, overrides), resume_run=args.resume)
    # a process exiting with the gloo group alive can die in std::terminate; destroyed now, the group DeepSpeed keeps
    # for the process would be gone for a later run in it: destroyed at exit (registered once)
    atexit.unregister(destroy_process_group)
    atexit.register(destroy_process_group)
    return 0


def destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """What the launchers run in each process (`python -m training.train`)."""
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    code = main()
    # A launched process ends here: its group torn down, then out without C++ static destructors, which under
    # torchrun can still abort a finished rank ("terminate called without an active exception", gloo's threads)
    destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
