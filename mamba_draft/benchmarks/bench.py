"""Spec-Bench-style side-by-side benchmark: every method on the same prompts, same process, warm-up, repeats."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from mamba_draft.benchmarks.equality import compare_outputs
from mamba_draft.benchmarks import llama_cpp
from mamba_draft.benchmarks.methods import HF_KINDS, LLAMA_CPP, Method, Models, load_plain, parse_method, run_hf, run_ours
from mamba_draft.benchmarks.report import bar_plot, fmt_mean_std, line_plot, markdown_table, mean_std, write_json, write_text
from mamba_draft.checkpoint import DRAFTER_HELP
from mamba_draft.devices import check_device, resolve_dtype
from mamba_draft.dtypes import DTYPES
from mamba_draft.heldout import SPEC_BENCH
from mamba_draft.targets import PRODUCTS, auto_dtype, integer_products
from tree_search.policy import parse_policy
from tree_search.prompts import Prompt, encode_prompt, load_prompts
from tree_search.sampling import SamplingParams, resolve_sampling

DEFAULT_METHODS = ("hf-ar", "ar", "default", "chain:5", "3,2,2,1,1", "bandit")
# what a user has without us (BASELINE_NAMES): every speedup is stated against the fastest of those that ran
BASELINES = ("ar", "hf-ar", "llama-cpp")
BASELINE_NAMES = "our plain decoding, transformers' generate on the plain model, llama.cpp on the GGUF"
BATCH_WARMUP_TOKENS = 8  # a batch sweep's warm-up pays one-time costs (first calls, allocations), not a full batch
# the layout of run_benchmark's result (one entry per batch size under "batches"): cached results of another layout
# (the demo's) are measured again
RESULT_LAYOUT = 3


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
    batch_sizes: tuple[int, ...] = (1,)
    bandit_memory: str = "call"      # bandits restart on every generate call, or learn over a whole "pass"
    # method -> the number of leading batches it decodes (a budget's cut of a slow baseline; the others run all)
    shares: dict[str, int] | None = None


def resolve_methods(specs) -> list[Method]:
    """Parse the method list and add each one's same-harness autoregressive baseline if missing (run first): every
    speedup has a baseline measured beside it (both, when the list has methods of both harnesses)."""
    methods = [parse_method(s) for s in specs]
    if not methods:
        raise ValueError("no methods to benchmark")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate methods in {names}")
    for base in BASELINES:
        if base not in names and any(m.baseline == base for m in methods):
            methods.insert(0, parse_method(base))
    return methods


def eos_ids(models: Models) -> list[int]:
    eos = getattr(models.target.generation_config, "eos_token_id", None)
    if eos is None and models.tokenizer is not None:
        eos = models.tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def check_verifiers(methods: list[Method], params: SamplingParams) -> None:
    """Refuse greedy-only verifiers when sampling."""
    if params.greedy:
        return
    from tree_search import get_verifier

    for m in methods:  # a verifier of None (`default`) is generate's own pick for the temperature
        if m.kind == "spec" and m.verifier and getattr(get_verifier(m.verifier), "greedy_only", False):
            raise ValueError(f"method {m.name!r}: verifier {m.verifier!r} is greedy-only; "
                             f"use {m.name.partition('@')[0]}@sampling at temperature {params.temperature}")


class Batch(NamedTuple):
    start: int                        # index of its first prompt (row b is prompt start + b, seeded seed + start + b)
    ids: torch.Tensor                 # (1, L) one prompt, or (B, L) left-padded prompts
    mask: torch.Tensor | None         # None for one prompt (the single-prompt path), else the (B, L) attention mask


def make_batches(prompt_ids: list[torch.Tensor], size: int) -> list[Batch]:
    """Consecutive groups of `size` prompts (the last may be smaller), left-padded; size 1: the prompts as they are."""
    from tree_search.plan import batch_prompts

    if size == 1:
        return [Batch(i, ids, None) for i, ids in enumerate(prompt_ids)]
    device = prompt_ids[0].device
    padded = {start: batch_prompts([p[0] for p in prompt_ids[start:start + size]], None)  # pads are masked
              for start in range(0, len(prompt_ids), size)}
    return [Batch(start, ids.to(device), mask.to(device)) for start, (ids, mask, _) in padded.items()]


class Pass:
    """One method's pass over batches, fed batch by batch so that methods can alternate: its tree policy (a bandit
    kept over the whole pass when cfg.bandit_memory is "pass"), per-prompt outputs and per-batch records."""

    def __init__(self, method: Method, models: Models, cfg: BenchConfig, eos: list[int], seed: int) -> None:
        self.method, self.models, self.cfg, self.eos, self.seed = method, models, cfg, eos, seed
        self.policy = (parse_policy(method.tree, persistent=cfg.bandit_memory == "pass")
                       if method.kind == "spec" else None)
        self.pad = models.tokenizer.pad_token_id if models.tokenizer is not None else None
        self.sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        self.decoders: dict = {}  # run_ours's SpeculativeDecoders, kept over the pass
        self.outputs: list[list[int]] = []
        self.records: list[dict] = []

    def run(self, *batches: Batch) -> Pass:
        method, cfg = self.method, self.cfg
        for start, ids, mask in batches:
            if method.kind in HF_KINDS:
                if cfg.temperature > 0:
                    torch.manual_seed(self.seed + start)
                tokens, record = run_hf(method, self.models, ids, cfg.max_new_tokens, self.sampling, self.eos,
                                        self.pad, mask)
            elif method.kind == LLAMA_CPP:
                tokens, record = llama_cpp.run(self.models.llama_cpp, ids, cfg.max_new_tokens, self.sampling,
                                               self.eos, self.seed + start)
            else:
                tokens, record = run_ours(method, self.models, ids, cfg.max_new_tokens, self.sampling, self.eos,
                                          self.policy, self.seed + start, mask, self.decoders)
            self.outputs.extend([tokens] if mask is None else tokens)
            self.records.append(record)
        return self

    def result(self) -> dict:
        """Per-prompt outputs, per-batch records, and the pulls per tree shape summed over the pass's batches."""
        arms: dict[str, dict[str, int]] = {}
        for record in self.records:
            for shape, pulls in record.get("arm_pulls", {}).items():
                arms.setdefault(shape, {"pulls": 0})["pulls"] += pulls
        return {"outputs": self.outputs, "records": self.records, "arms": arms}


def reference_method(names) -> str:
    """What lossless methods must reproduce: `ar`, our plain decoding on the same exact model. Only a list of hf-*
    methods alone (resolve_methods adds `ar` to any of ours) is checked against `hf-ar`, transformers' greedy
    decoding on the same plain copy."""
    return "ar" if "ar" in names else "hf-ar"


def measure(methods: list[Method], models: Models, batches: list[Batch], cfg: BenchConfig, eos: list[int], bar,
            warmup: BenchConfig) -> dict[str, list[dict]]:
    """Untimed warm-up passes over the first batch (with `warmup`'s settings), then `repeats` passes of every
    method over every batch, the methods taking turns batch by batch (a machine whose speed drifts over minutes
    times every method on a batch within seconds) -> {method: [per repeat: outputs, records, arms]}."""
    for method in methods:
        for _ in range(cfg.warmup):
            Pass(method, models, warmup, eos, cfg.seed).run(*batches[:1])
    runs = {m.name: [] for m in methods}
    for repeat in range(cfg.repeats):
        passes = [Pass(method, models, cfg, eos, cfg.seed + 1000 * repeat) for method in methods]
        for b, batch in enumerate(batches):
            for one in passes:
                if b >= (cfg.shares or {}).get(one.method.name, len(batches)):
                    continue
                bar.set_postfix_str(f"repeat {repeat + 1}: {one.method.name}")
                one.run(batch)
                bar.update(batch.ids.shape[0])
        for one in passes:
            runs[one.method.name].append(one.result())
    return runs


def run_benchmark(models: Models, prompts: list[Prompt], methods: list[Method], cfg: BenchConfig,
                  progress: bool = True) -> dict:
    """For each of cfg.batch_sizes, every method over the same batches of that many prompts (`make_batches`), warm-up
    then `repeats` passes -> the JSON-able result, one entry per batch size under "batches".

    Lossless outputs are checked against per-prompt greedy decoding (`reference_method`), at every batch size:
    transformers' left-padded batched decoding may round differently from a prompt alone (its rows get the same
    check, so the table shows whether it does)."""
    from tqdm import tqdm

    # the sampling values every method uses: explicit ones, else the target's generation_config
    params = resolve_sampling(models.target, cfg.temperature, cfg.top_p, cfg.top_k)
    check_verifiers(methods, params)
    cfg = replace(cfg, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    device = next(models.target.parameters()).device
    encoded = [encode_prompt(models.tokenizer, p.text, cfg.chat_template, cfg.system_prompt) for p in prompts]
    prompt_ids = [torch.tensor([ids[-cfg.max_prompt_tokens:]], dtype=torch.long, device=device) for ids in encoded]
    eos = eos_ids(models)
    warmup = cfg if per_prompt(cfg) else replace(cfg, max_new_tokens=min(cfg.max_new_tokens, BATCH_WARMUP_TOKENS))
    total = cfg.repeats * sum(min(len(prompts), (cfg.shares or {}).get(m.name, len(prompts))) for m in methods) * len(
        cfg.batch_sizes)
    bar = tqdm(total=total, desc="bench", disable=not progress)
    runs = {}
    for size in cfg.batch_sizes:
        bar.set_description(f"bench batch {size}")
        runs[size] = measure(methods, models, make_batches(prompt_ids, size), cfg, eos, bar, warmup)
    bar.close()
    references, reference = None, reference_method([m.name for m in methods])
    if cfg.temperature == 0:  # the reference's greedy outputs, one prompt at a time: no extra pass when it ran
        lone = runs.get(1, {}).get(reference)
        lone = lone[0] if lone else Pass(parse_method(reference), models, cfg, eos, cfg.seed).run(
            *make_batches(prompt_ids, 1)).result()
        references = lone["outputs"]
    batches = {str(size): {"methods": {m.name: summarize(m, r, prompts, references, per_prompt(cfg)) for m in methods},
                           "runs": r} for size, r in runs.items()}
    device = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    return {"config": asdict(cfg), "device": device, "prompts": [asdict(p) for p in prompts],
            "prompt_tokens": [int(ids.shape[1]) for ids in prompt_ids], "reference": reference,
            "references": references, "baselines": baselines_of(runs[cfg.batch_sizes[0]]), "batches": batches}


def per_prompt(cfg: BenchConfig | dict) -> bool:
    """Batch size 1 alone: Spec-Bench's per-prompt table (rates per prompt, per category, bar plots); any other
    `batch_sizes`: a sweep (throughput over all batches, a table per size, plots over batch size)."""
    return tuple(cfg["batch_sizes"] if isinstance(cfg, dict) else cfg.batch_sizes) == (1,)


def tokens_per_s(records: list[dict]) -> float:
    """Spec-Bench: mean over prompts of new_tokens / wall_time."""
    return sum(r["new_tokens"] / r["wall_time"] for r in records) / len(records)


def tau(records: list[dict]) -> float:
    """Mean tokens committed per target forward (bonus included; 1.0 for autoregressive decoding)."""
    return sum(r["accepted"] for r in records) / max(sum(r["rounds"] for r in records), 1)


def baselines_of(runs: dict) -> list[str]:
    return [base for base in BASELINES if base in runs]


def speedups(runs: dict, name: str, rate, select=lambda records: records) -> dict[str, list[float]]:
    """Per repeat, method `name`'s `rate` of its records (narrowed by `select`) over the fastest baseline's in that
    repeat ("speedup", see BASELINES) and over each baseline that ran ("speedup_vs_ar", "speedup_vs_hf-ar", ...). A
    baseline cut to a share of the prompts (`BenchConfig.shares`) rates over the prompts it decoded."""
    def rates(method):
        return [rate(select(run["records"])) for run in runs[method]]

    mine = rates(name)
    # a baseline that decoded none of the selected prompts (a share) has no rate there
    bases = {base: rates(base) for base in baselines_of(runs) if select(runs[base][0]["records"])}
    out = {"speedup": [m / max(values[i] for values in bases.values()) for i, m in enumerate(mine)]}
    return out | {f"speedup_vs_{base}": [m / b for m, b in zip(mine, values)] for base, values in bases.items()}


def throughput(records: list[dict]) -> float:
    """All new tokens / the wall time of all batches (a batch's tokens share one wall time)."""
    return sum(r["new_tokens"] for r in records) / sum(r["wall_time"] for r in records)


def summarize(method: Method, runs: dict, prompts: list[Prompt], references, by_prompt: bool) -> dict:
    """One method at one batch size: tokens/s (`by_prompt`: Spec-Bench's mean over prompts, and per category; else
    all batches' throughput), τ, speedups against the baselines on the same prompts or batches, tree-shape pulls,
    the draft / verify time split and drafter state, equality with the references."""
    mine = runs[method.name]
    rate = tokens_per_s if by_prompt else throughput
    out = {"kind": method.kind, "tree": method.tree, "verifier": method.verifier, "lossless": method.lossless,
           "tokens_per_s": [rate(r["records"]) for r in mine], "tau": [tau(r["records"]) for r in mine],
           **speedups(runs, method.name, rate), "arms": mine[-1]["arms"]}
    if by_prompt:
        def only(category):
            return lambda records: [r for r, p in zip(records, prompts) if p.category == category]

        out["categories"] = {c: {"tokens_per_s": [tokens_per_s(only(c)(r["records"])) for r in mine],
                                 "tau": [tau(only(c)(r["records"])) for r in mine],
                                 **speedups(runs, method.name, tokens_per_s, only(c))}
                             for c in sorted({p.category for p in prompts}) if only(c)(mine[0]["records"])}
    drafted = [r for run in mine for r in run["records"] if "draft_time" in r]
    if drafted:
        total = sum(r["wall_time"] for r in drafted)
        out["time_split"] = {"draft": sum(r["draft_time"] for r in drafted) / total,
                             "verify": sum(r["verify_time"] for r in drafted) / total}
        # the drafter's state at its largest (a Transformer's KV rows grow with the context, a Mamba's stay fixed)
        out["drafter_state_mib"] = max(r.get("drafter_state_bytes", 0) for r in drafted) / 2**20
    if references is not None:
        out["equality"] = equality(references, mine)
    return out


def equality(references: list[list[int]], repeats: list[dict]) -> dict:
    """The worst repeat's comparison with the references, and whether every repeat was identical."""
    checks = [compare_outputs(references[:len(run["outputs"])], run["outputs"]) for run in repeats]  # a share: its own
    worst = min(checks, key=lambda e: (e.n_identical, e.prefix_agreement))
    return asdict(worst) | {"summary": worst.summary(), "all_repeats_identical": all(e.identical for e in checks)}


def equality_cell(summary: dict) -> str:
    if "equality" not in summary:
        return "n/a (sampling)"
    eq = summary["equality"]
    if summary["lossless"] and eq["all_repeats_identical"]:
        return "identical"
    if summary["lossless"] and summary["kind"] in HF_KINDS:  # transformers on the plain copy: its rounding, not ours
        return eq["summary"] + " (transformers' generate, plain model)"
    if summary["kind"] == LLAMA_CPP:  # another implementation of the model: agreement, not equality
        return eq["summary"] + " (llama.cpp, the GGUF's own weights)"
    if summary["lossless"]:
        return "**" + eq["summary"] + "**"
    return f"lossy: {eq['n_identical']}/{eq['n_prompts']} identical, prefix agreement {eq['prefix_agreement']:.2f}"


def reference_text(result: dict) -> str:
    return {"ar": "plain decoding (ar)"}.get(result.get("reference"), "transformers' greedy (hf-ar)")


def baseline_text(baselines: list[str]) -> str:
    """What the speedups are against: "best of ar/hf-ar/llama-cpp" (those that ran), else the one that did, said so."""
    if len(baselines) > 1:
        return "best of " + "/".join(baselines)
    missing = [base for base in BASELINES if base not in baselines]
    return f"{baselines[0]} ({', '.join(missing)} not run)"


def markdown_report(result: dict) -> str:
    """The methods' table (tokens/s, τ, speedup vs the fastest baseline and vs each, drafter state, equality):
    one prompt at a time with speedups per category, or for a sweep one table per batch size and tokens/s by size.
    The first line says what a time budget cut from the measurement (the demo's)."""
    cfg, batches, baselines, budget = result["config"], result["batches"], result["baselines"], result.get("budget")
    sweep, reference = not per_prompt(cfg), reference_text(result)
    both = baselines if len(baselines) > 1 else []  # with several baselines, a speedup column for each as well
    where = "on the same batches" if sweep else "on the same prompts"
    prompts = f"{len(result['prompts'])} prompts" + (
        f" in left-padded batches of {', '.join(batches)} (the last batch of a size may be smaller)" if sweep else "")
    sampling = (f" (top-k {cfg['top_k'] or 'off'}, top-p {cfg['top_p']})" if cfg["temperature"] else " (greedy)")
    text = ((f"**{budget['summary']}**\n\n" if budget and budget["cuts"] else "")
            + f"{prompts}, {cfg['max_new_tokens']} new tokens max, temperature {cfg['temperature']}{sampling}, "
            f"{cfg['repeats']} repeats (mean ± std), device: {result['device']}."
            + (" tokens/s = all new tokens / wall time of all batches." if sweep else "")
            + (f" Speedups are against the fastest of {', '.join(f'`{b}`' for b in both)} ({BASELINE_NAMES}) {where}, "
               "repeat by repeat." if both else f" Speedups are against `{baselines[0]}` {where}: "
               f"{baseline_text(baselines)}.")
            + "".join(f" `{name}` decoded the first {k} of the {len(result['prompts'])} prompts (the time budget's "
                      "cut of the slowest baseline): its speedups are over those." for name, k in
                      (cfg.get("shares") or {}).items() if k < len(result["prompts"]))
            + (f" Outputs compared with per-prompt greedy {reference}." if sweep else "")
            + (" Bandit methods learn over the whole pass (`--bandit-memory pass`), not afresh per call."
               if cfg.get("bandit_memory", "call") == "pass" else "") + "\n")
    header = ["method", "verifier", "tokens/s", "τ", f"speedup vs {baseline_text(baselines)}",
              *(f"vs {b}" for b in both), "drafter state", f"output vs {reference}"]
    for size, entry in batches.items():
        methods = entry["methods"]
        rows = [[name, (s["verifier"] or "auto") if s["kind"] == "spec" else "–", fmt_mean_std(s["tokens_per_s"], 1),
                 fmt_mean_std(s["tau"]),
                 *(fmt_mean_std(s[key]) + "×" for key in ["speedup", *(f"speedup_vs_{b}" for b in both)]),
                 f"{s['drafter_state_mib']:.2f} MiB" if s.get("drafter_state_mib") else "–", equality_cell(s)]
                for name, s in methods.items()]
        text += (f"\n### Batch size {size}\n\n" if sweep else "\n") + markdown_table(header, rows)
        if not sweep:
            text += categories_table(methods, baselines)
        what = "batched rounds, last repeat" if sweep else "last repeat"
        text += "".join(f"\nArm pulls of `{name}` ({what}): "
                        + ", ".join(f"{a} {int(v['pulls'])}" for a, v in s["arms"].items()) + "\n"
                        for name, s in methods.items() if len(s["arms"]) > 1)  # the bandit methods
    if sweep:
        names = list(next(iter(batches.values()))["methods"])
        rows = [[name] + [f"{mean_std(entry['methods'][name]['tokens_per_s'])[0]:.1f}" for entry in batches.values()]
                for name in names]
        text += "\nTokens/s by batch size:\n\n" + markdown_table(["method"] + list(batches), rows)
    return text


def categories_table(methods: dict, baselines: list[str]) -> str:
    """Speedup (τ) per prompt category, when there are several."""
    categories = sorted({c for s in methods.values() for c in s["categories"]})
    if len(categories) < 2:
        return ""
    rows = [[name] + [f"{mean_std(s['categories'][c]['speedup'])[0]:.2f}× (τ {mean_std(s['categories'][c]['tau'])[0]:.2f})"
                      if c in s["categories"] else "–" for c in categories] for name, s in methods.items()]
    return f"\nSpeedup vs {baseline_text(baselines)} (τ) per category:\n\n" + markdown_table(["method"] + categories, rows)


def write_outputs(result: dict, out_dir: str | Path, prefix: str = "bench") -> dict[str, Path]:
    """JSON (everything), the markdown tables, and PNG plots: bars of tokens/s, τ and speedup one prompt at a time;
    for a sweep, lines of speedup and tokens/s over batch size."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / f"{prefix}.json", "markdown": out_dir / f"{prefix}.md"}
    write_json(paths["json"], result)
    write_text(paths["markdown"], markdown_report(result))
    plots = bar_plots if per_prompt(result["config"]) else batch_plots
    return paths | plots(result, out_dir, prefix)


def bar_plots(result: dict, out_dir: Path, prefix: str) -> dict[str, Path]:
    methods = result["batches"]["1"]["methods"]
    names = list(methods)
    lossy = [not methods[n]["lossless"] for n in names]
    plots = {"tokens_png": ("tokens_per_s", f"Decoding throughput ({result['device']})", "tokens / s", None),
             "tau_png": ("tau", "Mean accepted tokens per target forward (τ)", "τ", 1.0),
             "speedup_png": ("speedup", f"Speedup vs {baseline_text(result['baselines'])}", "× tokens/s", 1.0)}
    paths = {}
    for path, (key, title, ylabel, baseline) in plots.items():
        paths[path] = out_dir / f"{prefix}_{key}.png"
        bar_plot(paths[path], names, [methods[n][key] for n in names], title, ylabel, baseline=baseline, lossy=lossy)
    return paths


def batch_plots(result: dict, out_dir: Path, prefix: str) -> dict[str, Path]:
    paths = {"speedup_png": out_dir / f"{prefix}_batch_speedup.png",
             "tokens_png": out_dir / f"{prefix}_batch_tokens_per_s.png"}
    batches = result["batches"]
    sizes = [int(size) for size in batches]
    names = list(next(iter(batches.values()))["methods"])
    base = baseline_text(result["baselines"])

    def series(key):
        return {n: [mean_std(batches[str(b)]["methods"][n][key])[0] for b in sizes] for n in names}

    line_plot(paths["speedup_png"], sizes, series("speedup"), f"Speedup vs {base} ({result['device']})", "batch size",
              f"× tokens/s of {base} on the same batches", baseline=1.0)
    line_plot(paths["tokens_png"], sizes, series("tokens_per_s"), f"Throughput ({result['device']})", "batch size",
              "tokens / s (all batches)")
    return paths


# ------------------------------------------------------------------------------------------------ CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--target", required=True, help="causal LM to accelerate: HF directory, hub id or .gguf "
                        "file; 'smollm2' is the shipped SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--drafter", help=DRAFTER_HELP + "; needed by drafting methods")
    parser.add_argument("--prompts", type=Path, help="Spec-Bench question.jsonl or JSONL with 'prompt' (default: the "
                        "held-out, odd-id questions of the Spec-Bench copy shipped in mamba_draft/data)")
    parser.add_argument("--methods", nargs="+", default=list(d.methods),
                        help="hf-ar hf-assisted hf-lookup llama-cpp ar default, or a tree policy in generate --tree's "
                        "grammar (auto none 3,2,2,1,1 chain:N bandit[:A/B/...] bandit-time[:A/B/...]); "
                        "METHOD+lookup[:K] METHOD@VERIFIER assistant:METHOD verifier=NAME LABEL=METHOD; `default` is "
                        "what `generate` runs by default on --device, hf-* run transformers' generate on plain copies "
                        "of the models")
    parser.add_argument("--assistant", help="small Transformer sharing the target's tokenizer: the assistant of "
                        "hf-assisted, and the drafter of assistant: methods in our engine")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--limit", type=int, help="use at most this many prompts")
    parser.add_argument("--per-category", type=int, help="use the first N prompts of each category")
    parser.add_argument("--split", choices=("heldout", "train", "all"),
                        help="Spec-Bench questions to use: heldout = odd ids (evaluation), train = the others (tuning: "
                        "choosing arms or shapes), all (default: heldout without --prompts, else all)")
    parser.add_argument("--temperature", type=float,
                        help="0 = greedy (default: the target's generation_config, as target.generate)")
    parser.add_argument("--top-p", type=float, help="nucleus mass when sampling (default: generation_config, 1.0)")
    parser.add_argument("--top-k", type=int, help="top-k when sampling, 0 = off (default: generation_config, 50)")
    parser.add_argument("--no-chat-template", action="store_true", help="encode prompts as raw text")
    parser.add_argument("--system-prompt", help="system message placed before every prompt by the chat template")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="dtype of every model, hf-* copies included (auto, the default: as `mamba-draft generate` "
                        "picks it)")
    parser.add_argument("--products", choices=PRODUCTS, default="auto",
                        help="our methods' target products, as `mamba-draft generate --products`: int8 (a GGUF's "
                        "codes as integers, llama.cpp's numerics; `ar` then decodes with them too), float (the "
                        "model's own) or auto (the default: int8 for a GGUF-coded target on an AVX2+ CPU)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--batch-size", type=parse_batch_sizes, default=d.batch_sizes, metavar="B[,B2,...]",
                        help="1 (default): the per-prompt table; else, for each size, every method decodes the "
                        "prompts in left-padded batches of B (hf-assisted is batch 1 only) and the tables report "
                        "throughput over all batches")
    parser.add_argument("--bandit-memory", choices=("call", "pass"), default=d.bandit_memory,
                        help="call (default): a bandit method starts afresh on every generate call (prompt or "
                        "batch), as generate's own bandit does; pass: one bandit learns over the whole pass, as a "
                        "server keeping its policy would")
    parser.add_argument("--out", type=Path, required=True, help="output directory (JSON, markdown, PNG)")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'8,1,4' -> (1, 4, 8): distinct positive integers, ascending for the tables and the plot's x axis (a bad
    value is argparse's one-line usage error)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    sizes = tuple(sorted(int(part) for part in parts))
    if len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(f"a batch size is given twice in {text!r}")
    return sizes


def validate(args: argparse.Namespace, methods: list[Method]) -> None:
    """Every argument problem is reported here, before any model is loaded."""
    from tree_search.generator import check_model_name

    for flag in ("target", "assistant", "tokenizer"):  # HF causal LMs and tokenizers: a directory, hub id or .gguf
        if getattr(args, flag):
            try:
                check_model_name(getattr(args, flag), "target")
            except ValueError as err:
                raise SystemExit(f"mamba-draft bench: error: --{flag}{str(err).removeprefix('target')}") from None
    drafter = args.drafter and Path(args.drafter)  # a local path must exist; anything else is a name or hub id
    if drafter and (args.drafter.startswith((".", "/", "~")) or drafter.exists()) and not drafter.expanduser().is_dir():
        raise FileNotFoundError(f"--drafter {args.drafter}: not a directory")
    if any(m.kind == "spec" and m.drafter == "drafter" for m in methods) and not args.drafter:
        raise ValueError("drafting methods need --drafter PATH")
    if any(m.drafter == "assistant" for m in methods) and not args.assistant:
        raise ValueError("assistant: methods draft with --assistant PATH (a small causal LM sharing the target's "
                         "tokenizer)")
    single = [m.name for m in methods if m.kind == "hf-lookup" or m.lookup]
    if single and max(args.batch_size) > 1:
        raise ValueError(f"{', '.join(single)}: prompt lookup decodes one prompt at a time: drop it or use "
                         "--batch-size 1")
    if any(m.kind == LLAMA_CPP for m in methods):
        if max(args.batch_size) > 1:
            raise ValueError("llama-cpp decodes one prompt at a time here: drop it or use --batch-size 1")
        if not llama_cpp.available():
            raise ImportError(f"the llama-cpp method needs llama-cpp-python: {llama_cpp.INSTALL}")
    if any(m.kind == "hf-assisted" for m in methods):
        if max(args.batch_size) > 1:
            raise ValueError("hf-assisted decodes one prompt at a time (transformers' assisted generation is batch 1 "
                             "only): drop it or use --batch-size 1")
        if not args.assistant:
            raise ValueError("hf-assisted needs --assistant PATH (a small Transformer sharing the target's tokenizer)")
        config = Path(args.assistant).expanduser() / "config.json"
        model_type = json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""
        if model_type.startswith(("mamba", "falcon_mamba")):
            raise ValueError(f"--assistant {args.assistant} is a {model_type} model: transformers' assisted "
                             "generation crashes with recurrent-state assistants; give a Transformer assistant")
    for flag, least in (("repeats", 1), ("max_new_tokens", 1), ("max_prompt_tokens", 1), ("warmup", 0)):
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    # explicit sampling values are checked now; unset ones come from the target once it is loaded (run_benchmark)
    check_verifiers(methods, resolve_sampling(None, args.temperature, args.top_p, args.top_k))
    if args.system_prompt is not None and args.no_chat_template:
        raise ValueError("--system-prompt needs the chat template; drop --no-chat-template")
    check_device(args.device)


def load_models(methods: list[Method], target, *, dtype: torch.dtype, device: str, tokenizer=None, drafter=None,
                assistant=None) -> Models:
    """Each model the methods need, once: the target as `generate` loads it (load_causal_lm's defaults), the drafter
    and the assistant for our engine, and for hf-* methods plain copies of the target (and assistant), what a user
    has without us (`methods.load_plain`), loaded only when one of them runs."""
    from mamba_draft.targets import load_causal_lm, load_tokenizer

    models = Models(target=load_causal_lm(target, dtype=dtype, device=device),
                    tokenizer=load_tokenizer(tokenizer or target))
    if any(m.kind == "spec" and m.drafter == "drafter" for m in methods):
        from mamba_draft import load_drafter

        models.drafter = load_drafter(drafter, device=device, dtype=dtype,
                                      embedding=models.target.get_input_embeddings().weight)
    if any(m.kind == "spec" and m.drafter == "assistant" for m in methods):
        from mamba_draft.checkpoint import read_draft_ids

        # the assistant only proposes: no row blocks or batch-invariant attention needed, and sdpa is its fastest
        models.assistant = load_causal_lm(assistant, dtype=dtype, device=device, attn_implementation="sdpa",
                                          row_blocks=False)
        models.assistant_draft_ids = read_draft_ids(assistant) if Path(assistant).is_dir() else None
    if any(m.kind in HF_KINDS for m in methods):
        models.plain_target = load_plain(target, dtype, device)
    if any(m.kind == "hf-assisted" for m in methods):
        models.plain_assistant = load_plain(assistant, dtype, device)
    if any(m.kind == LLAMA_CPP for m in methods):
        models.llama_cpp = llama_cpp.load(str(target))
    return models


def bench_prompts(args: argparse.Namespace) -> list:
    """--prompts (default: the shipped Spec-Bench) narrowed by --split, --per-category and --limit."""
    return load_prompts(args.prompts or SPEC_BENCH, limit=args.limit, per_category=args.per_category,
                        split=args.split or ("all" if args.prompts else "heldout"))


def run(args: argparse.Namespace) -> int:
    methods = resolve_methods(args.methods)
    validate(args, methods)
    prompts = bench_prompts(args)
    if max(args.batch_size) > len(prompts):  # a table for batch size B needs a batch of B prompts
        raise ValueError(f"--batch-size {max(args.batch_size)} needs at least that many prompts; "
                         f"{args.prompts} gives {len(prompts)}")
    same = ("repeats", "warmup", "max_new_tokens", "max_prompt_tokens", "temperature", "top_p", "top_k", "seed",
            "system_prompt", "bandit_memory")  # the fields its flags set as they are
    cfg = BenchConfig(methods=tuple(m.name for m in methods), chat_template=not args.no_chat_template,
                      batch_sizes=args.batch_size, **{field: getattr(args, field) for field in same})
    dtype = auto_dtype(args.target, args.device) if args.dtype == "auto" else resolve_dtype(args.dtype, args.device)
    models = load_models(methods, args.target, dtype=dtype, device=args.device,
                         tokenizer=args.tokenizer, drafter=args.drafter, assistant=args.assistant)
    models.integer_products = integer_products(args.products, models.target, args.target)
    result = run_benchmark(models, prompts, methods, cfg)
    result["models"] = {"target": args.target, "drafter": args.drafter, "assistant": args.assistant,
                        "products": "int8" if models.integer_products else "float"}
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
