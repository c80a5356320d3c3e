"""Convert a checkpoint: a Mamba drafter between HF (safetensors) and mamba_ssm (pytorch_model.bin) formats, or a
GGUF target (e.g. the shipped SmolLM2, alias `smollm2`) to a plain HF directory (model + tokenizer) that loads in
`transformers` with the same logits as transformers' GGUF loader gives."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from . import targets
from .checkpoint import (FORMATS, TARGET_EMBEDDING, check_tensors, detect_format, embedding_spec, load_checkpoint,
                         read_config, resolve_directory, save_checkpoint)
from .model import MambaDrafter


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, overwrite: bool = False) -> Path:
    """Convert a checkpoint directory (format detected) to `to`, bit-identically. A drafter stored without its
    embedding (`smollm2`) comes out whole, in fp32 with the target's embedding and tokenizer (plain transformers
    loads it)."""
    if to not in FORMATS:
        raise ValueError(f"unknown target format {to!r}; choose one of {FORMATS}")
    directory = resolve_directory(src)
    config, tensors = load_checkpoint(directory)
    borrowed = (directory / TARGET_EMBEDDING).is_file()
    tokenizer = targets.load_tokenizer(embedding_spec(directory)[0]) if borrowed else None
    with torch.device("meta"):  # checked against the config before anything is written
        tensors = check_tensors(MambaDrafter(config, backend="torch"), tensors, where=str(directory))
    return save_checkpoint(config, tensors, dst, format=to, overwrite=overwrite, copy_from=directory,
                           dtype=torch.float32 if borrowed else None, tokenizer=tokenizer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source checkpoint directory, or a .gguf file / 'smollm2' with --from gguf")
    parser.add_argument("dst", help="destination directory (must not exist unless --overwrite)")
    parser.add_argument("--from", dest="src_format", choices=(*FORMATS, "gguf"),
                        help="expected source format (detected from config.json; given, it is checked); "
                        "gguf: a GGUF causal LM, written as an HF directory")
    parser.add_argument("--to", dest="dst_format", choices=FORMATS,
                        help="destination format (required for drafters; GGUF sources always become hf)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")


def run(args: argparse.Namespace) -> int:
    if args.src_format == "gguf":
        from .targets import convert_gguf, resolve_gguf

        if args.dst_format not in (None, "hf"):
            raise SystemExit(f"mamba-draft convert: error: a GGUF model converts to hf, not {args.dst_format}")
        if resolve_gguf(args.src) is None:
            raise SystemExit(f"mamba-draft convert: error: {args.src} is not a .gguf file (or a directory holding one)")
        out = convert_gguf(args.src, args.dst, overwrite=args.overwrite)
        print(f"wrote HF model + tokenizer to {out}")
        return 0
    if args.dst_format is None:
        raise SystemExit("mamba-draft convert: error: --to hf|mamba_ssm is required")
    detected = detect_format(read_config(resolve_directory(args.src)))
    if args.src_format and args.src_format != detected:
        raise SystemExit(f"mamba-draft convert: error: {args.src} is a {detected} checkpoint, not {args.src_format}")
    out = convert(args.src, args.dst, to=args.dst_format, overwrite=args.overwrite)
    print(f"wrote {args.dst_format} checkpoint to {out}")
    return 0
