"""Export a DeepSpeed training checkpoint (any ZeRO stage) to an HF-format (or mamba_ssm-format) model directory."""
from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mamba_draft.checkpoint import DRAFT_VOCAB, EMBEDDING, embedding_digest, load_checkpoint, save_checkpoint
from mamba_draft.convert import convert
from mamba_draft.io import atomic_directory
from mamba_draft.targets import load_causal_lm
from training.model import TrainableDrafter

FORMATS = ("hf", "mamba_ssm")
FROZEN_WEIGHTS = "frozen.safetensors"  # in a run's model/ dir: parameters training kept frozen


def locate(checkpoint_dir: str | Path) -> tuple[Path, Path, str]:
    """(run dir with model/, DeepSpeed save dir, tag) for a training output dir or its checkpoints/ dir."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not (ckpt / "latest").is_file():
        raise FileNotFoundError(f"no 'latest' file in {ckpt}: not a DeepSpeed checkpoint directory "
                                "(expected the training output_dir or its checkpoints/ subdirectory)")
    tag = (ckpt / "latest").read_text().strip()
    if not (ckpt / tag).is_dir():
        raise FileNotFoundError(f"{ckpt}/latest names {tag!r}, which does not exist")
    run = ckpt.parent if ckpt.name == "checkpoints" else ckpt
    if not (run / "model" / "config.json").is_file():
        raise FileNotFoundError(f"{run / 'model'} has no config.json: was this checkpoint written by training.train?")
    return run, ckpt, tag


def consolidated_model(run: Path, ckpt: Path, tag: str) -> torch.nn.Module:
    """Gather the fp32 master weights from the (possibly ZeRO-partitioned) checkpoint into a fresh HF model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag)
    if (run / "model" / FROZEN_WEIGHTS).is_file():  # parameters frozen in training (not in the optimizer)
        state.update(load_file(str(run / "model" / FROZEN_WEIGHTS)))
    config = AutoConfig.from_pretrained(run / "model")
    if getattr(config, "target_hidden_size", 0):  # a drafter that reads the target: transformers has no fusion
        model = TrainableDrafter(config)
        model.load_hf_state_dict(state)  # strict: names every missing or unexpected key
        return model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied head is the embedding itself: its key may be absent when the embedding was frozen
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt / tag} does not match {run / 'model'}: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    return model


def export(checkpoint_dir: str | Path, out_dir: str | Path, format: str = "hf", overwrite: bool = False,
           lean_target: str | None = None) -> Path:
    """Write `out_dir` (safetensors + config + tokenizer files, or mamba_ssm config + pytorch_model.bin).

    `lean_target`: a Mamba drafter whose tied embedding is that target's, frozen: write its trained parameters only,
    in bf16, with the embedding's digest (`mamba_draft.checkpoint.TARGET_EMBEDDING`; how a drafter ships)."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {FORMATS}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    run, ckpt, tag = locate(checkpoint_dir)
    config = AutoConfig.from_pretrained(run / "model")
    model_type = config.model_type
    if format == "mamba_ssm" and model_type not in ("mamba", "mamba2"):
        raise ValueError(f"--format mamba_ssm needs a Mamba model, this checkpoint is {model_type!r}")
    if format == "mamba_ssm" and getattr(config, "target_hidden_size", 0):
        raise ValueError("--format mamba_ssm: a drafter that reads the target has no mamba_ssm form (no input "
                         "fusion there); export it in the hf format")
    if lean_target is not None and (format != "hf" or model_type not in ("mamba", "mamba2")):
        raise ValueError("--lean-from-target needs a Mamba drafter exported in the hf format")
    if lean_target is not None and not getattr(config, "tie_word_embeddings", False):
        raise ValueError("--lean-from-target needs a drafter whose head is tied to its embedding")

    model = consolidated_model(run, ckpt, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    if lean_target is not None:
        wanted = load_causal_lm(lean_target, attn_implementation=None).get_input_embeddings().weight
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as staging:
            _write_hf(model, run, Path(staging))
            lean_config, tensors = load_checkpoint(staging)
        if embedding_digest(tensors[EMBEDDING]) != embedding_digest(wanted):
            raise ValueError(f"the drafter's embedding is not {lean_target!r}'s (was it trained with "
                             "model.init_embeddings_from and model.freeze_embeddings?)")
        save_checkpoint(lean_config, tensors, out, overwrite=True, dtype=torch.bfloat16, embedding_from=lean_target)
    elif format == "mamba_ssm":  # stage the HF export, then convert it (conversion is itself atomic)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as staging:
            _write_hf(model, run, Path(staging))
            convert(staging, out, to="mamba_ssm", overwrite=True)
    else:
        with atomic_directory(out, overwrite=True) as tmp:
            _write_hf(model, run, tmp)
    return out


def _write_hf(model: torch.nn.Module, run: Path, directory: Path) -> None:
    model.save_pretrained(directory)  # safetensors (a drafter that reads the target: mamba_draft's HF layout)
    AutoTokenizer.from_pretrained(run / "model").save_pretrained(directory)
    if (run / "model" / DRAFT_VOCAB).is_file():  # the draft vocabulary's id map travels with the weights
        shutil.copy2(run / "model" / DRAFT_VOCAB, directory / DRAFT_VOCAB)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="training output_dir (or its checkpoints/ dir with a 'latest' file)")
    parser.add_argument("out_dir", help="directory to write the model to")
    parser.add_argument("--format", choices=FORMATS, default="hf", help="hf (default) or mamba_ssm")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    parser.add_argument("--lean-from-target", metavar="TARGET",
                        help="a drafter whose tied embedding is TARGET's, frozen: write only its trained parameters "
                        "(bf16) and the embedding's digest; it loads with TARGET's embedding (how a drafter ships)")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("deepspeed").setLevel(logging.WARNING)
    out = export(args.checkpoint_dir, args.out_dir, format=args.format, overwrite=args.overwrite,
                 lean_target=args.lean_from_target)
    print(f"exported {args.checkpoint_dir} -> {out} ({args.format})")
    return 0
