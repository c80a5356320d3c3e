"""Mine labelled target/draft mismatches (`mine`) and train an AutoJudge classifier on them (`train`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mamba_draft.checkpoint import DRAFTER_HELP
from mamba_draft.dtypes import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="{mine,train}")
    mine = actions.add_parser("mine", help="label mismatches important/unimportant (AutoJudge Algorithm 1)")
    mine.add_argument("--target", required=True, help="target causal LM (HF directory, hub id, .gguf file or smollm2)")
    mine.add_argument("--drafter", required=True, help=DRAFTER_HELP)
    mine.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field (or Spec-Bench 'turns')")
    mine.add_argument("--task", default="gsm8k", help="answer extraction: gsm8k (final number) or exact (whole text)")
    mine.add_argument("--out", required=True, help="output directory (one file per prompt; reruns resume)")
    mine.add_argument("--tokenizer", default=None, help="tokenizer (default: the target's)")
    mine.add_argument("--max-new-tokens", type=int, default=256)
    mine.add_argument("--limit", type=int, default=None, help="mine only the first N prompts")
    mine.add_argument("--no-chat-template", action="store_true", help="encode prompts as raw text")
    mine.add_argument("--device", default="cpu")
    mine.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                      help="target and drafter dtype (auto, the default: bfloat16 where the device has native bf16 "
                      "products, else float32; float32 keeps the mined features exact: half-precision ones drift "
                      "between sequential and parallel passes)")
    train = actions.add_parser("train", help="fit the logistic-regression judge on mined mismatches")
    train.add_argument("--data", required=True, help="directory written by `autojudge mine`")
    train.add_argument("--out", required=True, help="judge file to write (.safetensors)")
    train.add_argument("--val-fraction", type=float, default=0.2)
    train.add_argument("--recall", type=float, default=0.9, help="suggested threshold keeps this recall of important tokens")
    train.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    return _mine(args) if args.action == "mine" else _train(args)


def _mine(args: argparse.Namespace) -> int:
    from mamba_draft import load_drafter
    from mamba_draft.devices import check_device, resolve_dtype
    from mamba_draft.targets import load_causal_lm, load_tokenizer
    from tree_search.autojudge.answers import get_task
    from tree_search.autojudge.mine import mine
    from tree_search.prompts import encode_prompt, load_prompts

    task = get_task(args.task)  # validate everything cheap before loading models
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = load_prompts(args.prompts, limit=args.limit, split="train")  # a classifier's training data: no held-out
    # "draft": the key directories mined so far hold (a resumed run must match them)
    manifest = {"target": str(args.target), "draft": str(args.drafter), "task": args.task,
                "prompts": str(Path(args.prompts).resolve()), "chat_template": not args.no_chat_template}
    check_device(args.device)
    dtype = resolve_dtype(args.dtype, args.device)
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    target = load_causal_lm(args.target, dtype=dtype, device=args.device)
    drafter = load_drafter(args.drafter, target=target)  # on the target's device, in its dtype
    encoded = [encode_prompt(tokenizer, p.text, use_chat_template=not args.no_chat_template) for p in prompts]
    counts = mine(target, drafter.forward, encoded, task, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  args.out, args.max_new_tokens, tokenizer.eos_token_id, manifest)
    print(json.dumps(counts))
    return 0


def _train(args: argparse.Namespace) -> int:
    from tree_search.autojudge.mine import load_mined
    from tree_search.autojudge.train import TrainConfig, train_judge

    cfg = TrainConfig(val_fraction=args.val_fraction, seed=args.seed, recall=args.recall)
    features, labels = load_mined(args.data)
    head = train_judge(features, labels, cfg)
    head.save(args.out)
    print(json.dumps(head.info, indent=2))
    return 0
