"""Convert a Mamba drafter checkpoint between HF (safetensors) and mamba_ssm (pytorch_model.bin) formats."""
from __future__ import annotations

import argparse

from .checkpoint import FORMATS, convert, detect_format, read_config, resolve_directory


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="source checkpoint directory")
    parser.add_argument("dst", help="destination directory (must not exist unless --overwrite)")
    parser.add_argument("--from", dest="src_format", choices=FORMATS,
                        help="expected source format (detected from config.json; given, it is checked)")
    parser.add_argument("--to", dest="dst_format", choices=FORMATS, required=True, help="destination format")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")


def run(args: argparse.Namespace) -> int:
    detected = detect_format(read_config(resolve_directory(args.src)))
    if args.src_format and args.src_format != detected:
        raise SystemExit(f"mamba-draft convert: {args.src} is a {detected} checkpoint, not {args.src_format}")
    out = convert(args.src, args.dst, to=args.dst_format, overwrite=args.overwrite)
    print(f"wrote {args.dst_format} checkpoint to {out}")
    return 0
