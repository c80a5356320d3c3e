"""Process-group setup for `deepspeed`, `torchrun` and plain single-process runs, and the DeepSpeed JSON."""
from __future__ import annotations

import importlib
import json
import os
import socket
from pathlib import Path

import deepspeed
import torch

from training.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
SINGLE_PROCESS_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def init_distributed(build_shm_comm: bool = True) -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed (once per process); returns (rank, world_size).

    Under a launcher the env vars are set; a plain `python` process becomes a world of one (else DeepSpeed would try
    MPI discovery) and keeps it for later in-process runs (DeepSpeed caches its process groups per process).
    `build_shm_comm=False` skips the JIT compile of DeepSpeed's CPU shared-memory op: it only serves tensor-parallel
    inference, which training never does."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(SINGLE_PROCESS_ENV, MASTER_PORT=str(port))
    if not build_shm_comm:
        # `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm re-exports it)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed()
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def use_bf16(precision: str) -> bool:
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    return precision == "bf16" or (precision == "auto" and torch.cuda.is_available())


def deepspeed_config(cfg: TrainConfig, world: int) -> dict:
    """The DeepSpeed JSON (ZeRO stage, bf16 block, ...) with batch, clipping and optimizer filled from cfg."""
    path = Path(cfg.deepspeed).expanduser()  # configs/deepspeed/*.json: from the cwd, then from the repository
    path = path if path.exists() or path.is_absolute() else REPO_ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {cfg.deepspeed}")
    ds = json.loads(path.read_text())
    per_step = cfg.micro_batch_size * world
    if cfg.global_batch_size % per_step:
        raise ValueError(f"global_batch_size {cfg.global_batch_size} is not a multiple of "
                         f"micro_batch_size {cfg.micro_batch_size} x world size {world}")
    o = cfg.optim
    ds.update(
        train_batch_size=cfg.global_batch_size,
        train_micro_batch_size_per_gpu=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.global_batch_size // per_step,
        gradient_clipping=o.clip,
        steps_per_print=10**9,  # progress goes to our tqdm bar and metrics.jsonl
        # torch_adam: torch.optim.AdamW instead of JIT-compiling DeepSpeed's fused Adam
        optimizer={"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                "weight_decay": o.weight_decay, "torch_adam": True}},
    )
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": use_bf16(cfg.precision)}
    ds.pop("fp16", None)
    return ds
