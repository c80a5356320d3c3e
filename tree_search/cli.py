"""Generate text with a target model by tree speculative decoding with a drafter (Mamba or Transformer), or plainly
(--autoregressive), then print stats."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.dtypes import DTYPES
from tree_search.policy import GRAMMAR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HF causal LM directory, hub id or .gguf file with its "
                        "tokenizer; 'smollm2' is the shipped SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--drafter", help="drafter: a Mamba checkpoint (HF or mamba_ssm format), any HF causal LM "
                        "sharing the target's tokenizer (a Transformer drafter), a hub id, or 'smollm2' (the drafter "
                        "shipped for the shipped target)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file whose whole content is the prompt")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--tree", metavar="SPEC", help=f"the tree policy: {GRAMMAR}. A shape such as 3,2,2,1,1 is "
                       "fixed (a chain is 1,1,1,1 or chain:4; 'none' drafts nothing: plain decoding on the same "
                       "harness); bandit is UCB over the paper's shapes (3,3,2,1 / 3,2,2,1,1 / 2,2,2,1,1,1) or the arms "
                       "given, e.g. bandit:2,1/1,1,1, with the paper's reward (Eq. 2), bandit-time with each round's "
                       "measured tokens per second (an arm 'none' is a plain round, the fallback when drafting does not "
                       "pay). Default auto: the device's own, on a CPU bandit-time:none/1,1/1,1,1/2,1 with "
                       "prompt-lookup rounds of <= 8 tokens, elsewhere the paper's bandit")
    shape.add_argument("--autoregressive", action="store_true", help="plain target decoding (baseline; no drafter)")
    parser.add_argument("--verifier", help="verifier name, or lossy ones joined by '+' to accept a token if any accepts "
                        "it, e.g. autojudge+dropmatch (default: greedy at temperature 0, else sampling)")
    parser.add_argument("--verifier-param", action="append", default=[], metavar="KEY=VALUE",
                        help="verifier parameter, repeatable; VALUE is YAML (0.3, .inf, true, naive); "
                        "NAME.KEY targets one verifier of a '+' combination, e.g. fly.theta=0.5")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="chains at temperature 0: prompt-lookup n-grams pre-verified by the drafter "
                        "(same output, fewer drafter calls)")
    parser.add_argument("--lookup-tokens", type=int, metavar="K",
                        help="prompt-lookup rounds: when the last 2-4 tokens occurred before (prompt or output), "
                        "verify the <= K tokens that followed them instead of a draft; 0: off (default: 8 with the "
                        "CPU's default policy, else 0)")
    parser.add_argument("--temperature", type=float,
                        help="0 = greedy (default: the target's generation_config, as target.generate; greedy unless "
                        "it sets do_sample)")
    parser.add_argument("--top-p", type=float, help="nucleus mass when sampling (default: generation_config, 1.0)")
    parser.add_argument("--top-k", type=int, help="top-k when sampling, 0 = off (default: generation_config, 50)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the prompt as raw text (default: the tokenizer's chat template, when it has one)")
    parser.add_argument("--system-prompt", help="system message placed before the prompt by the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="target and drafter dtype (auto, the default: bfloat16 where the device has native bf16 "
                        "products, else float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text + stats) instead of streaming")


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from mamba_draft import load_drafter
    from mamba_draft.targets import load_causal_lm, load_tokenizer
    from tree_search.calls import check_options, default_lookup_tokens
    from tree_search.generate import generate, generate_autoregressive
    from tree_search.policy import parse_policy
    from tree_search.prompts import encode_prompt
    from tree_search.sampling import resolve_sampling
    from tree_search.verifiers import get_verifier

    if not args.autoregressive and not args.drafter:
        fail("--drafter is required (or pass --autoregressive for the baseline)")
    if args.autoregressive and (args.verifier or args.verifier_param or args.prompt_lookup or args.lookup_tokens):
        fail("--autoregressive uses no drafter, so no --verifier, --verifier-param, --prompt-lookup or "
             "--lookup-tokens")
    if args.system_prompt is not None and args.no_chat_template:
        fail("--system-prompt needs the chat template; drop --no-chat-template")
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            fail(f"prompt file {args.prompt_file} does not exist")
        text = args.prompt_file.read_text()
    else:
        text = args.prompt
    check_target_path(args.target, "--target")
    check_device(args.device)
    if args.drafter and (args.drafter.startswith((".", "/")) or Path(args.drafter).exists()) \
            and not Path(args.drafter).is_dir():
        fail(f"--drafter {args.drafter} " + ("is not a directory" if Path(args.drafter).exists() else "does not exist"))
    # everything checkable without the models is checked before loading them; sampling left unset is only known
    # from the target's generation_config, so the checks run again once it is loaded
    sampling = resolve_sampling(None, args.temperature, args.top_p, args.top_k)
    spec = "auto" if args.tree is None else args.tree  # an empty --tree is a malformed spec, not an absent one
    tree = parse_policy(spec, args.device)
    lookup_tokens = args.lookup_tokens
    if lookup_tokens is None:
        lookup_tokens = default_lookup_tokens(spec, args.device, False, args.prompt_lookup)
    verifier_params = parse_verifier_params(args.verifier_param)

    def default_verifier(params):  # lossless either way
        return "greedy" if params.greedy else "sampling"

    verifier = get_verifier(args.verifier or default_verifier(sampling), **verifier_params)
    check_options(verifier, tree, sampling, args.prompt_lookup, lookup_tokens)

    dtype = resolve_dtype(args.dtype, args.device)
    tokenizer = load_tokenizer(args.target)
    target = load_causal_lm(args.target, dtype=dtype, device=args.device)
    sampling = resolve_sampling(target, args.temperature, args.top_p, args.top_k)
    if not args.verifier:
        verifier = get_verifier(default_verifier(sampling), **verifier_params)
    check_options(verifier, tree, sampling, args.prompt_lookup, lookup_tokens)
    ids = encode_prompt(tokenizer, text, use_chat_template=not args.no_chat_template, system_prompt=args.system_prompt)
    input_ids = torch.tensor([ids], dtype=torch.long)
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True)
    # the resolved values, passed explicitly so the printed stats and the run cannot disagree
    kwargs = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=args.seed,
                  max_new_tokens=args.max_new_tokens, streamer=streamer)
    if args.autoregressive:
        result = generate_autoregressive(target, input_ids, **kwargs)
    else:
        drafter = load_drafter(args.drafter, device=args.device, dtype=dtype,
                               embedding=target.get_input_embeddings().weight)
        result = generate(target, drafter, input_ids, tree=tree, verifier=verifier, tokenizer=tokenizer,
                          prompt_lookup=args.prompt_lookup, lookup_tokens=lookup_tokens, **kwargs)
    stats = result.stats
    if args.json:
        report = {"text": tokenizer.decode(result.new_tokens[0], skip_special_tokens=True),
                  "tokens": result.new_tokens[0].tolist(), "target_dtype": str(dtype).removeprefix("torch."),
                  **stats.to_dict()}
        print(json.dumps(report))
        return 0
    lines = [
        f"new tokens {stats.new_tokens} in {stats.total_time:.2f}s ({stats.tokens_per_s:.1f} tok/s), "
        f"{stats.rounds} rounds, {stats.target_forwards} target forwards",
        f"mean accepted length (tau) {stats.mean_accepted:.2f}; verifier {stats.verifier}"
        f"{'' if stats.lossless else ' (lossy, ' + str(stats.lossy_accepts) + ' lossy accepts)'}",
        "sampling: " + ("greedy" if sampling.greedy else
                        f"temperature {sampling.temperature:g}, top-k {sampling.top_k or 'off'}, top-p {sampling.top_p:g}"),
        f"time: draft {stats.draft_time:.3f}s, verify {stats.verify_time:.3f}s, other {stats.other_time:.3f}s",
        f"drafter calls {stats.drafter_calls}" + (f" ({stats.drafter_calls_saved} saved by prompt lookup)"
                                                   if args.prompt_lookup else "")
        + (f"; {stats.lookup_rounds} prompt-lookup rounds" if lookup_tokens else ""),
        f"target dtype {str(dtype).removeprefix('torch.')}",
    ]
    if len(stats.lossy_accepts_by) > 1:
        lines.append("lossy accepts by rule: " + ", ".join(f"{k} {v}" for k, v in stats.lossy_accepts_by.items()))
    lines += [f"  tree {shape}: {arm['pulls']} rounds, mean reward {arm['mean_reward']:.3f}" for shape, arm in stats.arms.items()]
    print("\n" + "\n".join(lines), file=sys.stdout)
    return 0


def fail(message: str):
    """A one-line usage error for `mamba-draft generate` (exit status 1)."""
    raise SystemExit(f"mamba-draft generate: error: {message}")


def check_target_path(path: str, flag: str, command: str = "generate") -> None:
    """Refuse a target that cannot load, before loading anything: a local path must be a model directory or a .gguf
    file; 'smollm2' needs its wheel; any other name is left to the hub."""
    from mamba_draft.targets import SHIPPED_TARGET, resolve_gguf

    local = Path(path).expanduser()
    if path != SHIPPED_TARGET and path.startswith((".", "/", "~")) and not local.exists():
        raise SystemExit(f"mamba-draft {command}: error: {flag} {path} does not exist")
    try:
        resolve_gguf(path)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"mamba-draft {command}: error: {flag} {path}: {err}") from None


def parse_verifier_params(items: list[str]) -> dict:
    """['theta=0.5', 'fly.window=4'] -> {'theta': 0.5, 'fly.window': 4}; values are parsed as YAML."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            fail(f"--verifier-param expects KEY=VALUE, got {item!r}")
        if key in params:
            fail(f"--verifier-param {key} is given twice")
        try:
            params[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            fail(f"--verifier-param {key}: cannot parse {value!r} ({err})")
    return params
