"""Generate text with a target model and a Mamba tree drafter (tree speculative decoding), then print stats."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HF causal LM directory (or hub id) with its tokenizer")
    parser.add_argument("--drafter", help="Mamba drafter directory (HF or mamba_ssm format) or hub id")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file whose whole content is the prompt")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--tree", help="fixed tree shape, e.g. 3,2,2,1,1 (a chain is 1,1,1,1)")
    shape.add_argument("--bandit", action="store_true", help="UCB over tree shapes (the default)")
    shape.add_argument("--autoregressive", action="store_true", help="plain target decoding (baseline; no drafter)")
    parser.add_argument("--arms", help="bandit arms separated by ';', e.g. '3,3,2,1;3,2,2,1,1;1,1,1,1'")
    parser.add_argument("--bandit-reward", choices=("paper", "time"), default="paper",
                        help="bandit reward: paper Eq. 2 (acceptance and depth) or measured tokens per second per round")
    parser.add_argument("--verifier", help="verifier name, or lossy ones joined by '+' to accept a token if any accepts "
                        "it, e.g. autojudge+dropmatch (default: greedy at temperature 0, else sampling)")
    parser.add_argument("--verifier-param", action="append", default=[], metavar="KEY=VALUE",
                        help="verifier parameter, repeatable; VALUE is YAML (0.3, .inf, true, naive); "
                        "NAME.KEY targets one verifier of a '+' combination, e.g. fly.theta=0.5")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="chains at temperature 0: prompt-lookup n-grams pre-verified by the drafter "
                        "(same output, fewer drafter calls)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text + stats) instead of streaming")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    from mamba_draft import MambaDrafter
    from tree_search.bandit import DEFAULT_ARMS, UCBBandit
    from tree_search.generate import check_options, generate, generate_autoregressive, make_policy
    from tree_search.sampling import SamplingParams
    from tree_search.verifiers import get_verifier

    if not args.autoregressive and not args.drafter:
        raise SystemExit("mamba-draft generate: --drafter is required (or pass --autoregressive for the baseline)")
    if args.arms and (args.tree or args.autoregressive):
        raise SystemExit("mamba-draft generate: --arms only applies to the bandit")
    if args.autoregressive and (args.verifier or args.verifier_param or args.prompt_lookup):
        raise SystemExit("mamba-draft generate: --autoregressive uses no drafter, so no --verifier, "
                         "--verifier-param or --prompt-lookup")
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise SystemExit(f"mamba-draft generate: prompt file {args.prompt_file} does not exist")
        text = args.prompt_file.read_text()
    else:
        text = args.prompt
    for flag in ("target", "drafter"):
        path = getattr(args, flag)
        if path and (path.startswith((".", "/")) or Path(path).exists()) and not Path(path).is_dir():
            raise SystemExit(f"mamba-draft generate: --{flag} {path} is not a directory")
    # everything checkable without the models is checked before loading them
    sampling_params = SamplingParams(args.temperature, args.top_k, args.top_p)
    arms = tuple(args.arms.split(";")) if args.arms else DEFAULT_ARMS
    tree = make_policy(args.tree or UCBBandit(arms=arms, reward=args.bandit_reward))
    verifier_name = args.verifier or ("greedy" if args.temperature == 0 else "sampling")
    verifier = get_verifier(verifier_name, **parse_verifier_params(args.verifier_param))
    check_options(verifier, tree, sampling_params, args.prompt_lookup)

    dtype = DTYPES[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa")
    target = target.to(args.device).eval()
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.autoregressive:
        result = generate_autoregressive(target, input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer,
                                         **sampling)
    else:
        drafter = MambaDrafter.from_pretrained(args.drafter, device=args.device, dtype=dtype)
        result = generate(target, drafter, input_ids, max_new_tokens=args.max_new_tokens, tree=tree,
                          verifier=verifier, tokenizer=tokenizer, streamer=streamer, prompt_lookup=args.prompt_lookup,
                          **sampling)
    stats = result.stats
    if args.json:
        report = {"text": tokenizer.decode(result.new_tokens[0], skip_special_tokens=True),
                  "tokens": result.new_tokens[0].tolist(), **stats.to_dict()}
        print(json.dumps(report))
        return 0
    lines = [
        f"new tokens {stats.new_tokens} in {stats.total_time:.2f}s ({stats.tokens_per_s:.1f} tok/s), "
        f"{stats.rounds} rounds, {stats.target_forwards} target forwards",
        f"mean accepted length (tau) {stats.mean_accepted:.2f}; verifier {stats.verifier}"
        f"{'' if stats.lossless else ' (lossy, ' + str(stats.lossy_accepts) + ' lossy accepts)'}",
        f"time: draft {stats.draft_time:.3f}s, verify {stats.verify_time:.3f}s, other {stats.other_time:.3f}s",
        f"drafter calls {stats.drafter_calls}" + (f" ({stats.drafter_calls_saved} saved by prompt lookup)"
                                                   if args.prompt_lookup else ""),
    ]
    if len(stats.lossy_accepts_by) > 1:
        lines.append("lossy accepts by rule: " + ", ".join(f"{k} {v}" for k, v in stats.lossy_accepts_by.items()))
    lines += [f"  tree {shape}: {arm['pulls']} rounds, mean reward {arm['mean_reward']:.3f}" for shape, arm in stats.arms.items()]
    print("\n" + "\n".join(lines), file=sys.stdout)
    return 0


def parse_verifier_params(items: list[str]) -> dict:
    """['theta=0.5', 'fly.window=4'] -> {'theta': 0.5, 'fly.window': 4}; values are parsed as YAML."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SystemExit(f"mamba-draft generate: --verifier-param expects KEY=VALUE, got {item!r}")
        if key in params:
            raise SystemExit(f"mamba-draft generate: --verifier-param {key} is given twice")
        try:
            params[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise SystemExit(f"mamba-draft generate: --verifier-param {key}: cannot parse {value!r} ({err})") from None
    return params
