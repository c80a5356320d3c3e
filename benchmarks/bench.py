"""Spec-Bench-style side-by-side benchmark: every method on the same prompts, same process, warm-up, repeats."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.equality import compare_outputs
from benchmarks.methods import Method, Models, make_tree_policy, parse_method, run_hf, run_ours
from benchmarks.report import bar_plot, fmt_mean_std, markdown_table, mean_std, write_json, write_text
from mamba_draft.devices import check_device
from mamba_draft.dtypes import DTYPES, parse_dtype
from tree_search.prompts import Prompt, encode_prompt, load_prompts
from tree_search.sampling import SamplingParams, resolve_sampling

DEFAULT_METHODS = ("hf-ar", "ar", "chain", "tree:3,2,2,1,1", "bandit")


@dataclass
class BenchConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    repeats: int = 3
    warmup: int = 1                  # untimed passes of every method over the first prompt
    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024    # longer prompts keep their last tokens
    # None: the target's generation_config, as target.generate; run_benchmark resolves them once and every method
    # (hf-* and ours) gets the same explicit values, which the result's config records
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    chat_template: bool = True
    system_prompt: str | None = None


def resolve_methods(specs) -> list[Method]:
    """Parse the method list and add each one's same-harness autoregressive baseline if missing (run first)."""
    methods = [parse_method(s) for s in specs]
    if not methods:
        raise ValueError("no methods to benchmark")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate methods in {names}")
    for base in ("ar", "hf-ar"):
        if base not in names and any(m.baseline == base for m in methods):
            methods.insert(0, parse_method(base))
    return methods


def encode_prompts(tokenizer, prompts: list[Prompt], cfg: BenchConfig, device) -> list[torch.Tensor]:
    out = []
    for p in prompts:
        ids = encode_prompt(tokenizer, p.text, cfg.chat_template, cfg.system_prompt)[-cfg.max_prompt_tokens:]
        out.append(torch.tensor([ids], dtype=torch.long, device=device))
    return out


def eos_ids(models: Models) -> list[int]:
    eos = getattr(models.target.generation_config, "eos_token_id", None)
    if eos is None and models.tokenizer is not None:
        eos = models.tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def sampling_of(cfg: BenchConfig) -> dict:
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}


def resolve_config(cfg: BenchConfig, target, methods: list[Method]) -> BenchConfig:
    """cfg with the sampling values every method uses: explicit ones, else the target's generation_config."""
    params = resolve_sampling(target, cfg.temperature, cfg.top_p, cfg.top_k)
    check_verifiers(methods, params)
    return replace(cfg, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)


def check_verifiers(methods: list[Method], params: SamplingParams) -> None:
    """Refuse greedy-only verifiers when sampling."""
    if params.greedy:
        return
    from tree_search import get_verifier

    for m in methods:
        if m.kind == "spec" and getattr(get_verifier(m.verifier), "greedy_only", False):
            raise ValueError(f"method {m.name!r}: verifier {m.verifier!r} is greedy-only; "
                             f"use {m.name.partition('@')[0]}@sampling at temperature {params.temperature}")


def run_pass(method: Method, models: Models, prompt_ids: list[torch.Tensor], cfg: BenchConfig, eos: list[int],
             seed: int, bar=None) -> tuple[list[list[int]], list[dict], dict]:
    """One method over every prompt; returns outputs, per-prompt records and the tree shapes' pulls."""
    policy = make_tree_policy(method.tree) if method.kind == "spec" else None
    pad = models.tokenizer.pad_token_id if models.tokenizer is not None else None
    outputs, records = [], []
    for i, ids in enumerate(prompt_ids):
        if method.kind in ("hf-ar", "hf-assisted"):
            if cfg.temperature > 0:
                torch.manual_seed(seed + i)
            tokens, record = run_hf(method, models, ids, cfg.max_new_tokens, sampling_of(cfg), eos, pad)
        else:
            tokens, record = run_ours(method, models, ids, cfg.max_new_tokens, sampling_of(cfg), eos, policy, seed + i)
        outputs.append(tokens)
        records.append(record)
        if bar is not None:
            bar.update()
    arms: dict[str, dict[str, int]] = {}  # pulls per tree shape, summed over the pass's prompts
    for record in records:
        for shape, pulls in record.get("arm_pulls", {}).items():
            arms.setdefault(shape, {"pulls": 0})["pulls"] += pulls
    return outputs, records, arms


def reference_outputs(models: Models, prompt_ids, cfg: BenchConfig, eos: list[int]) -> list[list[int]]:
    """The target's own greedy `generate` output for every prompt (what lossless methods must reproduce)."""
    greedy = BenchConfig(**{**asdict(cfg), "temperature": 0.0})
    return run_pass(parse_method("hf-ar"), models, prompt_ids, greedy, eos, cfg.seed)[0]


def run_benchmark(models: Models, prompts: list[Prompt], methods: list[Method], cfg: BenchConfig,
                  progress: bool = True) -> dict:
    """Warm up, then `repeats` passes of every method over every prompt; returns the full JSON-able result."""
    from tqdm import tqdm

    cfg = resolve_config(cfg, models.target, methods)
    device = next(models.target.parameters()).device
    prompt_ids = encode_prompts(models.tokenizer, prompts, cfg, device)
    eos = eos_ids(models)
    greedy = cfg.temperature == 0
    for method in methods:
        for _ in range(cfg.warmup):
            run_pass(method, models, prompt_ids[:1], cfg, eos, cfg.seed)
    runs = {m.name: [] for m in methods}
    bar = tqdm(total=cfg.repeats * len(methods) * len(prompts), desc="bench", disable=not progress)
    for repeat in range(cfg.repeats):
        for method in methods:
            bar.set_postfix_str(f"repeat {repeat + 1}: {method.name}")
            outputs, records, arms = run_pass(method, models, prompt_ids, cfg, eos, cfg.seed + 1000 * repeat, bar)
            runs[method.name].append({"outputs": outputs, "records": records, "arms": arms})
    bar.close()
    references = None
    if greedy:  # hf-ar's greedy outputs are the target's own greedy generate: no extra pass when it ran
        references = runs["hf-ar"][0]["outputs"] if "hf-ar" in runs else reference_outputs(models, prompt_ids, cfg, eos)
    summaries = {m.name: summarize(m, runs, prompts, references) for m in methods}
    return {"config": asdict(cfg), "device": describe(device), "prompts": [asdict(p) for p in prompts],
            "prompt_tokens": [int(ids.shape[1]) for ids in prompt_ids], "references": references,
            "methods": summaries, "runs": runs}


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def tokens_per_s(records: list[dict]) -> float:
    """Spec-Bench: mean over prompts of new_tokens / wall_time."""
    return sum(r["new_tokens"] / r["wall_time"] for r in records) / len(records)


def tau(records: list[dict]) -> float:
    """Mean tokens committed per target forward (bonus included; 1.0 for autoregressive decoding)."""
    return sum(r["accepted"] for r in records) / max(sum(r["rounds"] for r in records), 1)


def summarize(method: Method, runs: dict, prompts: list[Prompt], references) -> dict:
    mine, base = runs[method.name], runs[method.baseline]
    categories = sorted({p.category for p in prompts})

    def select(records, category):
        return [r for r, p in zip(records, prompts) if p.category == category]

    out = {"kind": method.kind, "tree": method.tree, "verifier": method.verifier, "lossless": method.lossless,
           "baseline": method.baseline,
           "tokens_per_s": [tokens_per_s(r["records"]) for r in mine],
           "tau": [tau(r["records"]) for r in mine],
           "speedup": [tokens_per_s(r["records"]) / tokens_per_s(b["records"]) for r, b in zip(mine, base)],
           "arms": mine[-1]["arms"],
           "categories": {c: {"tokens_per_s": [tokens_per_s(select(r["records"], c)) for r in mine],
                              "tau": [tau(select(r["records"], c)) for r in mine],
                              "speedup": [tokens_per_s(select(r["records"], c)) / tokens_per_s(select(b["records"], c))
                                          for r, b in zip(mine, base)]} for c in categories}}
    drafted = [r for run in mine for r in run["records"] if "draft_time" in r]
    if drafted:
        total = sum(r["wall_time"] for r in drafted)
        out["time_split"] = {"draft": sum(r["draft_time"] for r in drafted) / total,
                             "verify": sum(r["verify_time"] for r in drafted) / total}
    if references is not None:
        checks = [compare_outputs(references, run["outputs"]) for run in mine]
        worst = min(checks, key=lambda e: (e.n_identical, e.prefix_agreement))
        out["equality"] = asdict(worst) | {"summary": worst.summary(), "all_repeats_identical": all(e.identical for e in checks)}
    return out


def equality_cell(summary: dict) -> str:
    if "equality" not in summary:
        return "n/a (sampling)"
    eq = summary["equality"]
    if summary["lossless"]:
        return "identical" if eq["all_repeats_identical"] else "**" + eq["summary"] + "**"
    return f"lossy: {eq['n_identical']}/{eq['n_prompts']} identical, prefix agreement {eq['prefix_agreement']:.2f}"


def markdown_report(result: dict) -> str:
    cfg = result["config"]
    header = ["method", "verifier", "tokens/s", "τ", "speedup", "vs", "output vs target greedy"]
    rows = [[name, s["verifier"] if s["kind"] == "spec" else "–", fmt_mean_std(s["tokens_per_s"], 1),
             fmt_mean_std(s["tau"]), fmt_mean_std(s["speedup"]) + "×", s["baseline"], equality_cell(s)]
            for name, s in result["methods"].items()]
    sampling = f"temperature {cfg['temperature']}" + (
        f" (top-k {cfg['top_k'] or 'off'}, top-p {cfg['top_p']})" if cfg["temperature"] else " (greedy)")
    text = (f"{len(result['prompts'])} prompts, {cfg['max_new_tokens']} new tokens max, {sampling}, "
            f"{cfg['repeats']} repeats (mean ± std), device: {result['device']}.\n\n" + markdown_table(header, rows))
    categories = list(next(iter(result["methods"].values()))["categories"])
    if len(categories) > 1:
        header = ["method"] + categories
        rows = [[name] + [f"{mean_std(s['categories'][c]['speedup'])[0]:.2f}× (τ {mean_std(s['categories'][c]['tau'])[0]:.2f})"
                          for c in categories] for name, s in result["methods"].items()]
        text += "\nSpeedup (τ) per category:\n\n" + markdown_table(header, rows)
    arms = {name: s["arms"] for name, s in result["methods"].items() if len(s["arms"]) > 1}
    for name, summary in arms.items():
        text += f"\nArm pulls of `{name}` (last repeat): " + ", ".join(
            f"({a}) {int(v['pulls'])}" for a, v in summary.items()) + "\n"
    return text


def write_outputs(result: dict, out_dir: str | Path, prefix: str = "bench") -> dict[str, Path]:
    """JSON (everything), markdown tables and PNG plots (tokens/s, τ, speedup)."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / f"{prefix}.json", "markdown": out_dir / f"{prefix}.md",
             "tokens_png": out_dir / f"{prefix}_tokens_per_s.png", "tau_png": out_dir / f"{prefix}_tau.png",
             "speedup_png": out_dir / f"{prefix}_speedup.png"}
    methods = result["methods"]
    names = list(methods)
    lossy = [not methods[n]["lossless"] for n in names]
    write_json(paths["json"], result)
    write_text(paths["markdown"], markdown_report(result))
    bar_plot(paths["tokens_png"], names, [methods[n]["tokens_per_s"] for n in names],
             f"Decoding throughput ({result['device']})", "tokens / s", lossy=lossy)
    bar_plot(paths["tau_png"], names, [methods[n]["tau"] for n in names],
             "Mean accepted tokens per target forward (τ)", "τ", baseline=1.0, lossy=lossy)
    bar_plot(paths["speedup_png"], names, [methods[n]["speedup"] for n in names],
             "Speedup vs same-harness autoregressive", "× tokens/s", baseline=1.0, lossy=lossy)
    return paths


# ------------------------------------------------------------------------------------------------ CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--target", required=True, help="causal LM to accelerate: HF directory, hub id or .gguf "
                        "file; 'smollm2' is the shipped SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--drafter", help="Mamba drafter directory (HF or mamba_ssm format); needed by drafting methods")
    parser.add_argument("--prompts", required=True, type=Path, help="Spec-Bench question.jsonl or JSONL with 'prompt'")
    parser.add_argument("--methods", nargs="+", default=list(d.methods),
                        help="hf-ar hf-assisted ar chain[:N] tree:3,2,2,1,1 bandit[:A/B] METHOD@VERIFIER verifier=NAME")
    parser.add_argument("--assistant", help="Transformer assistant for hf-assisted (Mamba assistants crash in transformers)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--limit", type=int, help="use at most this many prompts")
    parser.add_argument("--per-category", type=int, help="use the first N prompts of each category")
    parser.add_argument("--temperature", type=float,
                        help="0 = greedy (default: the target's generation_config, as target.generate)")
    parser.add_argument("--top-p", type=float, help="nucleus mass when sampling (default: generation_config, 1.0)")
    parser.add_argument("--top-k", type=int, help="top-k when sampling, 0 = off (default: generation_config, 50)")
    parser.add_argument("--no-chat-template", action="store_true", help="encode prompts as raw text")
    parser.add_argument("--system-prompt", help="system message placed before every prompt by the chat template")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=Path, required=True, help="output directory (JSON, markdown, PNG)")


def check_model_dir(path: str | None, flag: str) -> None:
    """Local paths must exist; anything else is treated as a hub id by the loader."""
    if path and (path.startswith((".", "/", "~")) or Path(path).exists()) and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(f"{flag} {path}: not a directory")


def model_type(path: str) -> str:
    config = Path(path).expanduser() / "config.json"
    return json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""


def validate(args: argparse.Namespace, methods: list[Method]) -> None:
    """Every argument problem is reported here, before any model is loaded."""
    from tree_search.cli import check_target_path

    for flag in ("target", "assistant", "tokenizer"):  # HF causal LMs and tokenizers: a directory, hub id or .gguf
        if getattr(args, flag):
            check_target_path(getattr(args, flag), "--" + flag, command="bench")
    check_model_dir(args.drafter, "--drafter")
    if any(m.kind == "spec" for m in methods) and not args.drafter:
        raise ValueError("drafting methods need --drafter PATH")
    if any(m.kind == "hf-assisted" for m in methods):
        if not args.assistant:
            raise ValueError("hf-assisted needs --assistant PATH (a small Transformer sharing the target's tokenizer)")
        if model_type(args.assistant).startswith(("mamba", "falcon_mamba")):
            raise ValueError(f"--assistant {args.assistant} is a {model_type(args.assistant)} model: transformers' assisted "
                             "generation crashes with recurrent-state assistants; give a Transformer assistant")
    for flag in ("repeats", "max_new_tokens", "max_prompt_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    # explicit sampling values are checked now; unset ones come from the target once it is loaded (resolve_config)
    check_verifiers(methods, resolve_sampling(None, args.temperature, args.top_p, args.top_k))
    if args.system_prompt is not None and args.no_chat_template:
        raise ValueError("--system-prompt needs the chat template; drop --no-chat-template")
    check_device(args.device)


def load_models(args: argparse.Namespace, methods: list[Method]) -> Models:
    from mamba_draft.targets import load_causal_lm, load_tokenizer

    dtype = parse_dtype(args.dtype)

    def causal_lm(path):
        return load_causal_lm(path, dtype=dtype, device=args.device, attn_implementation="sdpa")

    models = Models(target=causal_lm(args.target), tokenizer=load_tokenizer(args.tokenizer or args.target))
    if any(m.kind == "spec" for m in methods):
        from mamba_draft import MambaDrafter

        models.drafter = MambaDrafter.from_pretrained(args.drafter, device=args.device, dtype=dtype)
    if any(m.kind == "hf-assisted" for m in methods):
        models.assistant = causal_lm(args.assistant)
    return models


def config_from_args(args: argparse.Namespace, methods: list[Method]) -> BenchConfig:
    return BenchConfig(methods=tuple(m.name for m in methods), repeats=args.repeats, warmup=args.warmup,
                       max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                       chat_template=not args.no_chat_template, system_prompt=args.system_prompt)


def run(args: argparse.Namespace) -> int:
    methods = resolve_methods(args.methods)
    validate(args, methods)
    prompts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    cfg = config_from_args(args, methods)
    models = load_models(args, methods)
    result = run_benchmark(models, prompts, methods, cfg)
    result["models"] = {"target": args.target, "drafter": args.drafter, "assistant": args.assistant}
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
