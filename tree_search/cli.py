"""Generate text with a target model by tree speculative decoding with a drafter (Mamba or Transformer), or plainly
(--autoregressive), then print stats."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from mamba_draft.checkpoint import DRAFTER_HELP
from mamba_draft.dtypes import DTYPES
from mamba_draft.targets import PRODUCTS
from tree_search.plan import plan_call
from tree_search.policy import GRAMMAR, parse_policy
from tree_search.sampling import resolve_sampling


def add_model_arguments(parser: argparse.ArgumentParser, shape=None) -> None:
    """The target, drafter, tree policy, verifier, device and dtype: what `generate` and `serve` share."""
    parser.add_argument("--target", required=True, help="HF causal LM directory, hub id or .gguf file with its "
                        "tokenizer; 'smollm2' is the shipped SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--drafter", help=DRAFTER_HELP)
    (shape or parser).add_argument(
        "--tree", metavar="SPEC", help=f"the tree policy: {GRAMMAR}. A shape such as 3,2,2,1,1 is fixed (a chain is "
        "1,1,1,1 or chain:4; 'none' drafts nothing: plain decoding on the same harness); bandit is UCB over the "
        "paper's shapes (3,3,2,1 / 3,2,2,1,1 / 2,2,2,1,1,1) or the arms given, e.g. bandit:2,1/1,1,1, with the "
        "paper's reward (Eq. 2), bandit-time with each round's measured tokens per second (an arm 'none' is a plain "
        "round). Default auto: a measured-time bandit over none and the shapes this machine's verify costs and the "
        "drafter's acceptance favour (on a CPU, with prompt-lookup rounds of <= 8 tokens for one prompt)")
    parser.add_argument("--verifier", help="verifier name, or lossy ones joined by '+' to accept a token if any accepts "
                        "it, e.g. autojudge+dropmatch (default: greedy at temperature 0, else sampling)")
    parser.add_argument("--verifier-param", action="append", default=[], metavar="KEY=VALUE",
                        help="verifier parameter, repeatable; VALUE is YAML (0.3, .inf, true, naive); "
                        "NAME.KEY targets one verifier of a '+' combination, e.g. fly.theta=0.5")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="target and drafter dtype (auto, the default: bfloat16 where the device has native bf16 "
                        "products, else float32; float32 for a Llama-family GGUF on a CPU, whose compiled step is "
                        "faster in fp32, said in one line)")
    parser.add_argument("--products", choices=PRODUCTS, default="auto",
                        help="the target's products on a CPU: int8, a GGUF's Q4_1 / Q8_0 codes multiplied as integers "
                        "with activations quantized to 8 bits per block of 32, llama.cpp's numerics (output equal to "
                        "plain decoding with the same products); float, the model's own in its dtype (transformers' "
                        "numerics); auto (the default): int8 for a GGUF-coded target on a CPU with AVX2 or wider, "
                        "where it is faster, said in one line; else float")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_mutually_exclusive_group()
    add_model_arguments(parser, shape)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="file whose whole content is the prompt")
    shape.add_argument("--autoregressive", action="store_true", help="plain target decoding (baseline; no drafter)")
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
    for flag, kind, text in (
            ("--repetition-penalty", float, "transformers' repetition penalty (> 1 discourages repeats)"),
            ("--no-repeat-ngram-size", int, "never repeat an n-gram of this size"),
            ("--min-new-tokens", int, "no EOS before this many new tokens"),
            ("--frequency-penalty", float, "OpenAI's: minus this times each token's count among the new tokens"),
            ("--presence-penalty", float, "OpenAI's: minus this for each token among the new tokens")):
        parser.add_argument(flag, type=kind, help=f"{text}; applied at every verified position, losslessly "
                            "(default: the target's generation_config)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the prompt as raw text (default: the tokenizer's chat template, when it has one)")
    parser.add_argument("--system-prompt", help="system message placed before the prompt by the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object (text + stats) instead of streaming")


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    if not args.autoregressive and not args.drafter:
        fail("--drafter is required (or pass --autoregressive for the baseline)")
    if args.autoregressive and (args.verifier or args.verifier_param or args.prompt_lookup or args.lookup_tokens):
        fail("--autoregressive uses no drafter, so no --verifier, --verifier-param, --prompt-lookup or "
             "--lookup-tokens")
    if args.system_prompt is not None and args.no_chat_template:
        fail("--system-prompt needs the chat template; drop --no-chat-template")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        fail(f"prompt file {args.prompt_file} does not exist")
    text = args.prompt if args.prompt_file is None else args.prompt_file.read_text()
    generator = load_generator(args, None if args.autoregressive else args.drafter,
                               resolve_sampling(None, args.temperature, args.top_p, args.top_k),
                               prompt_lookup=args.prompt_lookup, lookup_tokens=args.lookup_tokens)
    lookup_tokens = generator.decoder.options.lookup_tokens
    dtype = str(generator.target.dtype).removeprefix("torch.")
    sampling = resolve_sampling(generator.target, args.temperature, args.top_p, args.top_k)
    streamer = None if args.json else TextStreamer(generator.tokenizer, skip_prompt=True)
    result = generator.generate(text, max_new_tokens=args.max_new_tokens, system_prompt=args.system_prompt,
                                chat_template=not args.no_chat_template, seed=args.seed, streamer=streamer,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                **{name: getattr(args, name) for name in LOGITS_FLAGS})
    stats = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.token_ids, "target_dtype": dtype, **stats.to_dict()}))
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
        f"target dtype {dtype}",
    ]
    if len(stats.lossy_accepts_by) > 1:
        lines.append("lossy accepts by rule: " + ", ".join(f"{k} {v}" for k, v in stats.lossy_accepts_by.items()))
    lines += [f"  {'' if shape == 'lookup' else 'tree '}{shape}: {arm['pulls']} rounds, mean reward "
              f"{arm['mean_reward']:.3f}" for shape, arm in stats.arms.items()]
    print("\n" + "\n".join(lines))
    return 0


LOGITS_FLAGS = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "frequency_penalty",
                "presence_penalty")  # generate's logits processors (`tree_search.processors`)


def load_generator(args: argparse.Namespace, drafter, sampling, *, prompt_lookup: bool = False,
                   lookup_tokens: int | None = None, batched: bool = False, command: str = "generate"):
    """The `SpeculativeGenerator` of `add_model_arguments`' flags: the model names and the call's plan checked
    first (`plan_call`, no model loaded; sampling left unset is only known from the target's generation_config, so
    the engine checks it again once the target is loaded)."""
    from tree_search.generator import SpeculativeGenerator, check_model_name, run_defaults

    for name, what in ((args.target, "target"), (drafter, "drafter")):
        if name is not None:
            try:
                check_model_name(name, what)
            except ValueError as err:
                fail(f"--{err}", command)
    defaults = run_defaults(args.device, args.dtype, args.target)  # what Python's SpeculativeGenerator picks too
    spec = defaults.tree if args.tree is None else args.tree  # an empty --tree is a malformed spec, not an absent one
    verifier_params = parse_verifier_params(args.verifier_param, command)
    plan = plan_call(None if drafter is None else parse_policy(spec), sampling, verifier=args.verifier,
                     verifier_params=verifier_params, prompt_lookup=prompt_lookup, lookup_tokens=lookup_tokens,
                     device=defaults.device, batched=batched)
    return SpeculativeGenerator(args.target, drafter, device=defaults.device, dtype=args.dtype, tree=spec,
                                verifier=args.verifier, verifier_params=verifier_params, prompt_lookup=prompt_lookup,
                                lookup_tokens=plan.lookup_tokens if drafter is not None else lookup_tokens,
                                products=args.products)


def fail(message: str, command: str = "generate"):
    """A one-line usage error for `mamba-draft COMMAND` (exit status 1)."""
    raise SystemExit(f"mamba-draft {command}: error: {message}")


def parse_verifier_params(items: list[str], command: str) -> dict:
    """['theta=0.5', 'fly.window=4'] -> {'theta': 0.5, 'fly.window': 4}; values are parsed as YAML."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            fail(f"--verifier-param expects KEY=VALUE, got {item!r}", command)
        if key in params:
            fail(f"--verifier-param {key} is given twice", command)
        try:
            params[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            fail(f"--verifier-param {key}: cannot parse {value!r} ({err})", command)
    return params
