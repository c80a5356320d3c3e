"""The GPU timings: drafter step (eager vs CUDA graph, torch vs kernels), tree drafting per shape, target verification
by tree size (dynamic vs static vs captured), the projected speedup at the paper's τ, batched trees vs batched
plain decoding, the host syncs in a round, and the greedy identity rate in the timing dtype (speculative output
against the target's own greedy `generate`, trees and a batch). One JSON and one markdown table (plus two plots) under --out.

Random weights of real shapes (no downloads): a Mamba-130M-shaped drafter (d 768 × 24, Mamba-1) and Pythia-1.4B /
6.9B-shaped GPT-NeoX targets, bf16. `scripts/gpu_check.sh` runs it on a GPU machine; `--smoke` runs tiny shapes
and few iterations anywhere (on CPU: eager and static paths only), which is how the suite checks this script.

Projected speedup = τ · T_target / T_round, T_round = drafting the tree (graphs) + verifying and committing it
(captured): what a round costs when everything between kernels is gone, at the τ the paper measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mamba_draft.benchmarks.bench_drafters import build_mamba
from mamba_draft.benchmarks.report import line_plot, markdown_table, write_json, write_text
from mamba_draft.devices import check_device

CHAINS = tuple((1,) * depth for depth in range(1, 9))
TREES = ((3, 2, 2, 1, 1), (3, 3, 2, 1), (2, 2, 2, 1, 1, 1))
CHAIN5 = (1, 1, 1, 1, 1)
# the paper's τ (Mamba Drafters, Pythia-6.9B target): a 5-chain, and the (3,2,2,1,1) tree
PAPER_TAU = {CHAIN5: 3.08, (3, 2, 2, 1, 1): 3.91}
# verification by tree size: the root alone, a 5-chain, (3,2,1), (3,2,2,1,1) (1 + 3 + 6 + 12 + 12 + 12 = 46 nodes)
VERIFY_TREES = {1: (), 6: CHAIN5, 16: (3, 2, 1), 46: (3, 2, 2, 1, 1)}


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int


@dataclass
class GpuTimingConfig:
    drafter: dict = field(default_factory=lambda: {"arch": "mamba1", "d_model": 768, "n_layer": 24,
                                                   "vocab_size": 50280})
    targets: dict = field(default_factory=lambda: {
        "pythia-1.4b": Shape(2048, 24, 16, 8192, 50304), "pythia-6.9b": Shape(4096, 32, 32, 16384, 50432)})
    batches: tuple[int, ...] = (1, 3, 6, 12, 24, 48)
    prefix: int = 512          # cached tokens before every timed verification
    batch: int = 8             # batched trees vs batched plain decoding
    identity_prompts: int = 12  # prompts of the identity rate, each decoded identity_tokens tokens
    identity_tokens: int = 32
    iters: int = 50
    warmup: int = 5
    dtype: str = "bfloat16"
    device: str = "cuda"


def smoke_config(device: str) -> GpuTimingConfig:
    return GpuTimingConfig(drafter={"arch": "mamba1", "d_model": 32, "n_layer": 2, "vocab_size": 96},
                           targets={"tiny-neox": Shape(64, 2, 4, 128, 104)}, batches=(1, 3), prefix=16, batch=2,
                           identity_prompts=3, identity_tokens=8, iters=2, warmup=1, dtype="float32", device=device)


def mean_ms(fn, cfg: GpuTimingConfig) -> float:
    """Mean milliseconds of `cfg.iters` back-to-back calls after `cfg.warmup` untimed ones: CUDA events around the
    loop (one sync at its end) on a GPU."""
    for _ in range(cfg.warmup):
        fn()
    device = torch.device(cfg.device)
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(cfg.iters):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / cfg.iters
    started = time.perf_counter()
    for _ in range(cfg.iters):
        fn()
    return (time.perf_counter() - started) * 1e3 / cfg.iters


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype):
    """A GPT-NeoX (Pythia) of `shape`, random weights, created on the device (a 6.9B model never sits on the host)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                           num_attention_heads=shape.heads, intermediate_size=shape.intermediate,
                           max_position_embeddings=4096, rotary_pct=0.25, use_parallel_residual=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPTNeoXForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval().requires_grad_(False)


def backends(drafter) -> list[str]:
    from mamba_draft.kernels import kernels_available

    on_cuda = drafter.device.type == "cuda"
    # 'fused' (opt-in until timed) before 'kernels', which stays the best backend that `tree_drafting` takes
    fused = ["fused"] if on_cuda and importlib.util.find_spec("triton") else []
    return ["torch"] + fused + (["kernels"] if on_cuda and kernels_available() else [])


def time_drafter_steps(drafter, cfg: GpuTimingConfig) -> list[dict]:
    """One step of B rows, eager and replayed from a graph, per backend."""
    from mamba_draft.graphs import StepRunner

    rows = []
    state = drafter.allocate_state(max(cfg.batches))
    for backend in backends(drafter):
        drafter.set_backend(backend)
        for graphs in [False, True] if drafter.device.type == "cuda" else [False]:
            runner = StepRunner(drafter, state, use_graphs=graphs)
            for batch in cfg.batches:
                tokens = torch.randint(0, drafter.vocab_size, (batch,), device=drafter.device)
                rows.append({"backend": backend, "graphs": graphs, "batch": batch,
                             "ms": mean_ms(lambda: runner.run(0, batch, tokens), cfg)})
            runner.invalidate()
    drafter.set_backend("torch")
    return rows


def kernel_profile(drafter, cfg: GpuTimingConfig, steps: int = 20) -> list[dict] | None:
    """Per backend and batch (smallest, largest), the kernels one graph-replayed drafter step launches and their
    summed device time beside the step's wall time: kernels summing far below the step mean a launch-bound step
    (the gaps between ~N small kernels), not a compute- or memory-bound one. None off CUDA."""
    if drafter.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from mamba_draft.graphs import StepRunner

    rows = []
    state = drafter.allocate_state(max(cfg.batches))
    for backend in backends(drafter):
        drafter.set_backend(backend)
        runner = StepRunner(drafter, state, use_graphs=True)
        for batch in (min(cfg.batches), max(cfg.batches)):
            tokens = torch.randint(0, drafter.vocab_size, (batch,), device=drafter.device)
            for _ in range(3):
                runner.run(0, batch, tokens)
            torch.cuda.synchronize()
            started = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    runner.run(0, batch, tokens)
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - started) * 1e3 / steps
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            by_name = Counter()  # ms per step
            for e in kernels:
                by_name[e.name] += e.device_time / 1e3 / steps
            rows.append({"backend": backend, "batch": batch, "kernels_per_step": len(kernels) / steps,
                         "kernel_ms_per_step": sum(by_name.values()), "profiled_wall_ms": wall_ms,
                         "top_kernels": [{"name": n[:80], "ms": ms} for n, ms in by_name.most_common(6)]})
        runner.invalidate()
    drafter.set_backend("torch")
    return rows


def tree_drafting(drafter, prompts: torch.Tensor, rows: int, vocab: int):
    """A TreeDrafter of `rows` rows on the drafter's best backend (graphs on CUDA), prefilled with `prompts` (B, L),
    and draft(config): B greedy top-k trees from the prompts' last tokens."""
    from tree_search.tree_drafter import TreeDrafter
    from tree_search.sampling import SamplingParams

    drafter.set_backend(backends(drafter)[-1])
    drafts = TreeDrafter(drafter, rows, vocab)
    logits, roots, greedy = drafts.prefill(prompts), prompts[:, -1], SamplingParams(temperature=0.0)
    return drafts, lambda config: drafts.draft(config, roots, logits, greedy, "topk", False, None)


def time_tree_drafting(drafter, cfg: GpuTimingConfig) -> list[dict]:
    """Drafting a whole tree from the root's logits, per shape (one prompt: a batch of one)."""
    from mamba_draft.tree import TreeConfig

    configs = [TreeConfig(c) for c in CHAINS + TREES]
    prompt = torch.randint(0, drafter.vocab_size, (1, 32), device=drafter.device)
    drafts, draft = tree_drafting(drafter, prompt, max(len(c.build()) for c in configs), drafter.vocab_size)
    rows = [{"tree": c.branching, "nodes": len(c.build()), "ms": mean_ms(lambda: draft(c), cfg)} for c in configs]
    drafts.runner.invalidate()
    drafter.set_backend("torch")
    chain5 = next(r["ms"] for r in rows if r["tree"] == CHAIN5)
    return [r | {"vs_chain5": r["ms"] / chain5} for r in rows]


def verify_call(state, tokens: torch.Tensor, tree, kept: list[list[int]]):
    """A call verifying `tokens` as `tree` in the TargetCache `state`, then committing the drafts `kept` per row
    (and the root: every call grows the cache)."""
    def verify():
        state.tree_forward(tokens, tree)
        state.commit(kept)
    return verify


def time_verification(model, cfg: GpuTimingConfig) -> list[dict]:
    """A forward over the root + tree after `prefix` cached tokens and its commit (the root kept), per tree size and
    cache kind. The cache grows by one token per call: max_len leaves room for every call."""
    from mamba_draft.targets.cache import TargetCache
    from mamba_draft.tree import Tree, TreeConfig

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    calls = (cfg.iters + cfg.warmup + 2) * len(VERIFY_TREES)
    # TargetCache kinds: dynamic or static storage, and on CUDA static storage captured in graphs
    captured = {"captured": {"static": True, "graphs": True}} if device.type == "cuda" else {}
    rows = []
    for mode, kwargs in ({"dynamic": {"static": False}, "static": {"static": True}} | captured).items():
        state = TargetCache(model, max_len=cfg.prefix + calls + max(VERIFY_TREES) + 1, **kwargs)
        state.prefill(torch.randint(0, vocab, (1, cfg.prefix), device=device))
        for size, branching in VERIFY_TREES.items():
            tree = TreeConfig(branching).build() if branching else Tree((-1,))
            tokens = torch.randint(0, vocab, (1, size), device=device)
            rows.append({"mode": mode, "tokens": size, "ms": mean_ms(verify_call(state, tokens, tree, [[]]), cfg)})
    return rows


def time_batched(model, drafter, cfg: GpuTimingConfig) -> list[dict]:
    """B prompts: one plain decoding step of every row vs drafting B trees + verifying them in one forward."""
    from mamba_draft.targets.cache import TargetCache
    from mamba_draft.tree import TreeConfig

    device, batch = drafter.device, cfg.batch
    vocab = min(model.config.vocab_size, drafter.vocab_size)
    # every timed call grows the cache by one token (the root kept); on CUDA the storage the engine uses there
    calls = (cfg.iters + cfg.warmup + 2) * (1 + len(PAPER_TAU))
    nodes = max(len(TreeConfig(b).build()) for b in PAPER_TAU)
    on_cuda = device.type == "cuda"
    state = TargetCache(model, max_len=cfg.prefix + calls + nodes + 1, static=on_cuda, graphs=on_cuda)
    prompts = torch.randint(0, vocab, (batch, cfg.prefix), device=device)
    state.prefill(prompts)
    roots = prompts[:, -1]
    plain = mean_ms(lambda: state.decode(roots), cfg)
    rows = [{"tree": (), "ms": plain, "draft_ms": 0.0}]
    for branching, tau in PAPER_TAU.items():
        config = TreeConfig(branching)
        drafts, draft = tree_drafting(drafter, prompts, batch * (len(config.build()) + 1), model.config.vocab_size)
        verify = verify_call(state, draft(config).tokens.clone(), config.build(), [[] for _ in range(batch)])
        ms, draft_ms = mean_ms(verify, cfg), mean_ms(lambda: draft(config), cfg)
        rows.append({"tree": branching, "ms": ms, "draft_ms": draft_ms, "tau": tau,
                     "projected_speedup": tau * plain / (ms + draft_ms)})
        drafts.runner.invalidate()
    drafter.set_backend("torch")
    return rows


# what torch's sync debug mode warns at each synchronizing op (c10 warn_or_error_on_sync); other warnings that
# mention synchronization (the mode's own once-per-process notice on being switched on) are not syncs
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(fn) -> list[str] | None:
    """Where `fn` makes the host wait for the device: one "file:line" (the Python line that called the syncing op)
    per sync, from torch's CUDA sync debug mode; off CUDA `fn` runs and None."""
    if not torch.cuda.is_available():
        fn()
        return None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]


def sync_counts(model, drafter, device: torch.device) -> dict:
    """Syncs in a captured drafting pass and a captured verify + commit (both should be 0), and per round of a
    whole `generate` call (one is the round's verdict, copied to the host). Off CUDA the same calls run eager and
    the counts are None."""
    from mamba_draft.targets.cache import TargetCache
    from mamba_draft.tree import TreeConfig
    from tree_search.generate import generate

    config = TreeConfig((3, 2, 2, 1, 1))
    vocab = min(model.config.vocab_size, drafter.vocab_size)
    prompt = torch.randint(0, vocab, (1, 64), device=device)
    _, draft = tree_drafting(drafter, prompt, len(config.build()), drafter.vocab_size)
    for _ in range(2):  # capture first
        draft(config)
    drafting = host_syncs(lambda: draft(config))
    tree = config.build()
    state = TargetCache(model, static=True, max_len=256, graphs=device.type == "cuda")
    state.prefill(prompt)
    verify = verify_call(state, torch.randint(0, vocab, (1, len(tree)), device=device), tree, [[1, 4]])
    verify()
    verifying = host_syncs(verify)
    rounds: list[int] = []

    def call():
        # generate's vocabulary check reads only len(tokenizer): the real vocabulary both random models pad (Pythia
        # GPT-NeoX's to 50304 / 50432 rows, the Mamba-130M drafter to 50280)
        result = generate(model, drafter, prompt, max_new_tokens=32, tree=config, temperature=0.0, verifier="greedy",
                          tokenizer=range(vocab))
        rounds.append(result.stats.rounds)

    call()
    whole = host_syncs(call)
    count = lambda sites: None if sites is None else len(sites)  # noqa: E731
    return {"captured_drafting": count(drafting), "captured_verify_commit": count(verifying),
            "generate_syncs": count(whole), "generate_rounds": rounds[-1],
            "syncs_per_round": None if whole is None else len(whole) / max(rounds[-1], 1),
            "sync_sites": {"captured_drafting": drafting, "captured_verify_commit": verifying,
                           "generate": None if whole is None else sorted(set(whole))}}


def identity_rates(model, drafter, cfg: GpuTimingConfig) -> list[dict]:
    """Exactness in the timing dtype on this device: greedy speculative output, per tree shape one prompt at a time
    and the prompts as one left-padded batch, against the target's own greedy `generate` of each prompt alone. GPU
    kernels choose their reduction order by shape (a root verified among T + 1 tokens, a row among B): a random-weight
    target's near-tied logits show any rounding that differs. Rows identical, and the first differing position."""
    from tree_search.divergence import divergence
    from tree_search.generate import SpeculativeDecoder

    vocab = min(model.config.vocab_size, drafter.vocab_size)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (24 + 4 * (i % 5),), generator=generator).tolist()
               for i in range(cfg.identity_prompts)]
    n = cfg.identity_tokens
    want = [model.generate(torch.tensor([p], device=drafter.device), max_new_tokens=n, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    rows = []
    for branching in PAPER_TAU:
        decoder = SpeculativeDecoder(model, drafter, tree=branching, tokenizer=range(vocab))
        alone = [decoder.generate(torch.tensor([p]), max_new_tokens=n).new_tokens[0].tolist() for p in prompts]
        batched = decoder.generate(prompts, max_new_tokens=n).new_tokens
        for mode, got in (("one prompt", alone), (f"batch {len(prompts)}", batched)):
            differ = sorted(d for g, w in zip(got, want) if (d := divergence(w, g).first_divergence) is not None)
            rows.append({"tree": branching, "mode": mode, "identical": len(prompts) - len(differ),
                         "rows": len(prompts), "first_difference": differ})
    return rows


def run_timings(cfg: GpuTimingConfig, progress=print) -> dict:
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    drafter = build_mamba(cfg.drafter, "torch", 0, device, dtype)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "torch": torch.__version__, "config": asdict(cfg), "backends": backends(drafter)}
    progress("drafter steps")
    result["drafter_steps"] = time_drafter_steps(drafter, cfg)
    progress("kernel profile")
    try:  # a profiler that cannot see graph kernels must not cost the timings after it
        result["kernel_profile"] = kernel_profile(drafter, cfg)
    except Exception as error:  # noqa: BLE001
        result["kernel_profile"] = {"error": f"{type(error).__name__}: {error}"}
    progress("tree drafting")
    result["tree_drafting"] = time_tree_drafting(drafter, cfg)
    result["targets"] = {}
    for name, shape in cfg.targets.items():
        progress(f"target {name}")
        model = build_target(shape, device, dtype)
        result["targets"][name] = {"verify": time_verification(model, cfg),
                                   "batched": time_batched(model, drafter, cfg),
                                   "syncs": sync_counts(model, drafter, device),
                                   "identity": identity_rates(model, drafter, cfg)}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["projected"] = projected(result)
    return result


def projected(result: dict) -> list[dict]:
    """τ · T_target / T_round per target and paper shape, from the fastest verification mode measured."""
    from mamba_draft.tree import TreeConfig

    drafting = {tuple(r["tree"]): r["ms"] for r in result["tree_drafting"]}
    rows = []
    for name, entry in result["targets"].items():
        # ms by tree size, the fastest mode's (every size of VERIFY_TREES is measured)
        best = {size: min(r["ms"] for r in entry["verify"] if r["tokens"] == size) for size in VERIFY_TREES}
        for branching, tau in PAPER_TAU.items():
            draft_ms, verify_ms = drafting[branching], best[len(TreeConfig(branching).build())]
            rows.append({"target": name, "tree": branching, "tau": tau, "target_ms": best[1], "draft_ms": draft_ms,
                         "verify_ms": verify_ms, "round_ms": draft_ms + verify_ms,
                         "speedup": tau * best[1] / (draft_ms + verify_ms)})
    return rows


def markdown_report(result: dict) -> str:
    def fmt(value: float) -> str:
        return f"{value:.3f}"

    def shape(tree) -> str:
        return ",".join(map(str, tree))

    def section(title: str, header: list[str], rows: list[list]) -> list[str]:
        return [f"## {title}", "", markdown_table(header, rows)]

    cfg, steps = result["config"], result["drafter_steps"]
    d, batches = cfg["drafter"], sorted({r["batch"] for r in steps})
    step_ms = {(r["backend"], r["graphs"], r["batch"]): r["ms"] for r in steps}
    out = [f"# GPU timings on {result['device']} (torch {result['torch']}, {cfg['dtype']})", ""]
    out += section(f"Drafter step (ms), {d['arch']} d{d['d_model']} x {d['n_layer']}, vocab {d['vocab_size']}",
                   ["backend", "mode"] + [f"B={b}" for b in batches],
                   [[backend, "graph" if graphs else "eager"] + [fmt(step_ms[backend, graphs, b]) for b in batches]
                    for backend in result["backends"] for graphs in sorted({r["graphs"] for r in steps})])
    profile = result.get("kernel_profile")
    if isinstance(profile, list):
        out += section("Drafter step, graph replay: kernels launched and their summed device time",
                       ["backend", "batch", "kernels/step", "kernel ms/step", "wall ms/step", "top kernels"],
                       [[r["backend"], r["batch"], f"{r['kernels_per_step']:.0f}", fmt(r["kernel_ms_per_step"]),
                         fmt(r["profiled_wall_ms"]),
                         "; ".join(f"{k['name'][:40]} {k['ms']:.3f}" for k in r["top_kernels"][:3])] for r in profile])
    elif profile:
        out += [f"kernel profile failed: {profile['error']}", ""]
    out += section("Tree drafting (ms, whole tree)", ["tree", "nodes", "ms", "vs 5-chain"],
                   [[shape(r["tree"]), r["nodes"], fmt(r["ms"]), f"{r['vs_chain5']:.2f}"]
                    for r in result["tree_drafting"]])
    for name, entry in result["targets"].items():
        modes = list(dict.fromkeys(r["mode"] for r in entry["verify"]))
        sizes = sorted({r["tokens"] for r in entry["verify"]})
        verify_ms = {(r["mode"], r["tokens"]): r["ms"] for r in entry["verify"]}
        out += section(f"{name}: verify + commit (ms) by tree size", ["mode"] + [f"{s} tokens" for s in sizes],
                       [[m] + [fmt(verify_ms[m, s]) for s in sizes] for m in modes])
        out += section(f"{name}: batch {cfg['batch']}, trees vs plain decoding (on CUDA: static storage, captured)",
                       ["tree", "verify ms", "draft ms", "τ", "projected speedup"],
                       [[shape(r["tree"]) or "plain", fmt(r["ms"]), fmt(r["draft_ms"]), r.get("tau", 1.0),
                         f"{r.get('projected_speedup', 1.0):.2f}"] for r in entry["batched"]])
        syncs = entry["syncs"]
        if syncs.get("generate_syncs") is not None:
            out += [f"host syncs — captured drafting: {syncs['captured_drafting']}, captured verify + commit: "
                    f"{syncs['captured_verify_commit']}, a whole generate call: {syncs['generate_syncs']} in "
                    f"{syncs['generate_rounds']} rounds", ""]
            out += [line for part, sites in syncs.get("sync_sites", {}).items() if sites
                    for line in (f"- {part} syncs at: {', '.join(sites)}", "")]
        out += section(f"{name}: greedy identity in {cfg['dtype']} (speculative vs the target's own `generate`, "
                       f"{cfg['identity_tokens']} tokens)", ["tree", "mode", "identical rows", "first differences"],
                       [[shape(r["tree"]), r["mode"], f"{r['identical']}/{r['rows']}",
                         ", ".join(map(str, r["first_difference"])) or "-"] for r in entry.get("identity", [])])
    out += section("Projected speedup = τ · T_target / T_round (batch 1)",
                   ["target", "tree", "τ", "T_target ms", "draft ms", "verify ms", "speedup"],
                   [[r["target"], shape(r["tree"]), r["tau"], fmt(r["target_ms"]), fmt(r["draft_ms"]),
                     fmt(r["verify_ms"]), f"{r['speedup']:.2f}"] for r in result["projected"]])
    return "\n".join(out)


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    paths = {"json": out_dir / "gpu_timings.json", "markdown": out_dir / "gpu_timings.md",
             "steps_png": out_dir / "gpu_drafter_steps.png", "verify_png": out_dir / "gpu_verify.png"}
    write_json(paths["json"], result)
    write_text(paths["markdown"], markdown_report(result))
    series = {}
    for r in sorted(result["drafter_steps"], key=lambda r: r["batch"]):  # one series per backend and mode
        series.setdefault(f"{r['backend']} {'graph' if r['graphs'] else 'eager'}", []).append(r["ms"])
    batches = sorted({r["batch"] for r in result["drafter_steps"]})
    line_plot(paths["steps_png"], batches, series, f"Drafter step ({result['device']})", "batch", "ms")
    verify = {}
    for name, entry in result["targets"].items():
        for r in entry["verify"]:
            verify.setdefault(f"{name} {r['mode']}", []).append(r["ms"])
    sizes = sorted({r["tokens"] for e in result["targets"].values() for r in e["verify"]})
    line_plot(paths["verify_png"], sizes, verify, f"Verify + commit ({result['device']})", "tree tokens", "ms")
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON, markdown and plots")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations: checks the script runs")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50)")
    parser.add_argument("--targets", nargs="+", default=None, help="target shapes to time (default: all)")


def run(args: argparse.Namespace) -> int:
    check_device(args.device)
    cfg = smoke_config(args.device) if args.smoke else GpuTimingConfig(device=args.device)
    if args.iters is not None:
        if args.iters < 1:
            raise ValueError(f"--iters must be >= 1, got {args.iters}")
        cfg.iters = args.iters
    if args.targets:
        if unknown := sorted(set(args.targets) - set(cfg.targets)):
            raise ValueError(f"unknown --targets {unknown}; choose from {sorted(cfg.targets)}")
        cfg.targets = {k: v for k, v in cfg.targets.items() if k in args.targets}
    result = run_timings(cfg, progress=lambda what: print(f"[gpu-timings] {what}", flush=True))
    paths = write_outputs(result, args.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
