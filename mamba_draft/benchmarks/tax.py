"""The exactness tax: what the exact target path (`load_causal_lm` + the engine's `TargetCache`) costs against
transformers' plain model (sdpa, no packing, no row blocks) on this machine, side by side in one run; and what a row
costs: the engine's forward over 1-64 rows, with the model's float products and with integer ones, beside this CPU's
memory floor and its product peak.

    mamba-draft tax [--target smollm2] [--dtype auto|bfloat16|float32] [--repeats 25]

Prints the CPU (model name and the flags that pick its kernels), the dtype, and per forward (a decoding step and the
verification of 4 and 16 tokens after a 100-token context, prefills of 64 and 768 tokens) the median milliseconds of
both paths, timed in turns, and their ratio. `--dtype bfloat16` measures the bf16 tax on a CPU without native bf16.
Then, where the compiled CPU step applies, the rows table (and a drafter's level over the same rows, `--drafter`) (`ROWS`, after the same context; the float and int8 paths
in turns): milliseconds per forward, each as a multiple of one row, the slope per extra row (least squares), the
memory floor (the step's weight bytes over this machine's measured read bandwidth) and the slope at the product
peak (a row's multiply-adds at the best rate the path's own kernel reaches, 256 rows through one layer's product).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from mamba_draft.benchmarks.methods import load_plain, timed
from mamba_draft.devices import cpu_info, resolve_dtype
from mamba_draft.dtypes import DTYPES
from mamba_draft.targets import SHIPPED_TARGET

CONTEXT = 100  # tokens cached before a decoding or verification forward
FORWARDS = (("step", 1), ("verify", 4), ("verify", 16), ("prefill", 64), ("prefill", 768))
ROWS = (1, 2, 4, 8, 16, 32, 64)  # rows of the forwards the rows table times
KERNEL_FLAGS = ("amx_int8", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def cpu_kind() -> str:
    flags = set(cpu_info("flags").split())
    return f"{cpu_info('model name') or 'unknown CPU'} ({' '.join(f for f in KERNEL_FLAGS if f in flags) or 'no AVX'})"


class PlainPath:
    """transformers' own forward over a DynamicCache, as its `generate` runs it."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        from mamba_draft.targets.facts import cache_keyword

        self.model, self.keyword, self.new_cache = model, cache_keyword(model), lambda: DynamicCache(config=model.config)

    def prefill(self, ids: torch.Tensor):
        cache = self.new_cache()
        self.model(input_ids=ids, **{self.keyword: cache}, use_cache=True, logits_to_keep=1)
        return cache

    def forward(self, cache, ids: torch.Tensor) -> None:
        """n tokens after the cache, then all but the first dropped again: every call grows the cache by one."""
        self.model(input_ids=ids, **{self.keyword: cache}, use_cache=True)
        if ids.shape[1] > 1:
            cache.crop(-(ids.shape[1] - 1))


class ExactPath:
    """The engine's target cache as `generate` makes it (static, with the compiled CPU step where it applies): a chain
    of n tokens verified, its root committed."""

    def __init__(self, model, max_len: int, integer_products: bool = False) -> None:
        self.model, self.max_len, self.integer_products = model, max_len, integer_products
        self.kept = None  # the static cache, reused by every prefill as a SpeculativeDecoder reuses it

    def prefill(self, ids: torch.Tensor):
        from mamba_draft.targets.cache import TargetCache

        self.kept = cache = TargetCache.for_call(self.model, self.max_len, kept=self.kept,
                                                 integer_products=self.integer_products)
        cache.prefill(ids)
        return cache

    def forward(self, cache, ids: torch.Tensor) -> None:
        from mamba_draft.tree import Tree

        cache.tree_forward(ids, Tree(tuple(range(-1, ids.shape[1] - 1))))
        cache.commit([[]])


@torch.no_grad()
def measure(plain, exact, repeats: int) -> list[dict]:
    """Median ms of each forward of FORWARDS through transformers' `plain` model and the engine's `exact` one (the
    same weights), the two taking turns call by call."""
    longest = max(n for _, n in FORWARDS) + CONTEXT
    paths = {"plain": PlainPath(plain), "exact": ExactPath(exact, longest + repeats + 2)}
    ids = torch.randint(0, plain.config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(0))
    rows = []
    for kind, n in FORWARDS:
        if kind == "prefill":
            calls = {name: (lambda p=p: p.prefill(ids[:, :n])) for name, p in paths.items()}
        else:
            caches = {name: p.prefill(ids[:, :CONTEXT]) for name, p in paths.items()}
            calls = {name: (lambda p=p, c=caches[name]: p.forward(c, ids[:, CONTEXT:CONTEXT + n]))
                     for name, p in paths.items()}
        ms = turns(calls, repeats)
        rows.append({"forward": kind, "tokens": n, **ms, "ratio": ms["exact"] / ms["plain"]})
    return rows


def turns(calls: dict, repeats: int) -> dict[str, float]:
    """Median ms of each call, the calls taking turns; two warm-up turns (packing, first touch, a grown cache)."""
    times = {name: [] for name in calls}
    for _ in range(repeats + 2):
        for name, call in calls.items():
            times[name].append(timed(call, torch.device("cpu"))[1])
    return {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}


@torch.no_grad()
def measure_rows(model, repeats: int) -> dict | None:
    """The rows table's figures (module docstring), or None where the compiled CPU step does not apply."""
    from mamba_draft.targets import cpu_step

    if not cpu_step.applies(model):
        return None
    max_len = CONTEXT + len(ROWS) * (repeats + 2) + max(ROWS) + 1
    paths = {"float": ExactPath(model, max_len)}
    if cpu_step.CpuStep(model, integer=True).has_integer_products:
        paths["int8"] = ExactPath(model, max_len, integer_products=True)
    ids = torch.randint(0, model.config.vocab_size, (1, CONTEXT + max(ROWS)), generator=torch.Generator().manual_seed(0))
    ms = {name: {} for name in paths}
    for n in ROWS:
        caches = {name: p.prefill(ids[:, :CONTEXT]) for name, p in paths.items()}
        for name, t in turns({name: (lambda p=p, c=caches[name]: p.forward(c, ids[:, CONTEXT:CONTEXT + n]))
                              for name, p in paths.items()}, repeats).items():
            ms[name][n] = t
    steps = {name: p.kept.step for name, p in paths.items()}  # the steps the caches timed, packed once
    bandwidth = read_bandwidth()
    return {"ms": ms, "bandwidth_gb_s": bandwidth / 1e9, "macs_per_row": steps["float"].multiply_adds(),
            **{name: {"slope_ms": slope(ms[name]), "floor_ms": 1e3 * step.weight_bytes() / bandwidth,
                      "peak_gmac_s": product_peak(step) / 1e9} for name, step in steps.items()}}


def slope(ms: dict[int, float]) -> float:
    """Least-squares ms per extra row."""
    rows, times = list(ms), list(ms.values())
    mean_r, mean_t = statistics.fmean(rows), statistics.fmean(times)
    return sum((r - mean_r) * (t - mean_t) for r, t in zip(rows, times)) / sum((r - mean_r) ** 2 for r in rows)


def read_bandwidth(mib: int = 256) -> float:
    """Bytes per second this machine reads with torch's threads (a sum over `mib` MiB, the best of 5)."""
    data = torch.ones(mib * 2**18)
    return data.numel() * 4 / min(timed(data.sum, torch.device("cpu"))[1] for _ in range(5))


def product_peak(step, rows: int = 256) -> float:
    """Multiply-adds per second of the step's own kernel: `rows` rows through layer 0's gate product, best of 5."""
    import ctypes

    from mamba_draft.targets import cpu_step

    weight, gate = step.layers[0].gate, step.model.model.layers[0].mlp.gate_proj
    x = torch.randn(rows, gate.in_features)
    out = torch.empty(rows, gate.out_features)
    call = lambda: cpu_step.library().cpu_linear(  # noqa: E731
        x.data_ptr(), rows, gate.in_features, ctypes.byref(weight), None, gate.out_features, out.data_ptr(),
        cpu_step.DTYPES[step.dtype], torch.get_num_threads())
    return rows * gate.in_features * gate.out_features / min(timed(call, torch.device("cpu"))[1] for _ in range(5))


def rows_report(table: dict) -> list[str]:
    names = list(table["ms"])
    lines = ["| rows | " + " | ".join(f"{n} ms | {n} x one row" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for r in ROWS:
        cells = " | ".join(f"{table['ms'][n][r]:.1f} | {table['ms'][n][r] / table['ms'][n][1]:.2f}x" for n in names)
        lines.append(f"| {r} | {cells} |")
    macs = table["macs_per_row"]
    lines += ["", f"A row is {macs / 1e6:.0f} M multiply-adds; this machine reads {table['bandwidth_gb_s']:.1f} GB/s.",
              "", "| products | slope per extra row, ms | memory floor of a step, ms | product peak, GMAC/s | "
              "a row at that peak, ms |", "|---|---|---|---|---|"]
    for n in names:
        t = table[n]
        lines.append(f"| {n} | {t['slope_ms']:.2f} | {t['floor_ms']:.2f} | {t['peak_gmac_s']:.0f} | "
                     f"{1e3 * macs / (t['peak_gmac_s'] * 1e9):.2f} |")
    return lines


def report(rows: list[dict]) -> list[str]:
    lines = ["| forward | plain (transformers) ms | exact (ours) ms | exact / plain |", "|---|---|---|---|"]
    for r in rows:
        what = f"{r['forward']}, {r['tokens']} token{'s' * (r['tokens'] > 1)}"
        if r["forward"] != "prefill":
            what += f" after {CONTEXT}"
        lines.append(f"| {what} | {r['plain']:.1f} | {r['exact']:.1f} | {r['ratio']:.2f}x |")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="target model (default: the shipped SmolLM2)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="auto (the default: bfloat16 where the CPU has native bf16 products, else float32, as "
                        "every command); bfloat16 measures the bf16 tax on any CPU")
    parser.add_argument("--repeats", type=int, default=25, help="timed calls per forward and path (medians)")
    parser.add_argument("--drafter", help="also time this drafter's step over the rows table's rows, its torch step "
                        "against the backend `auto` picks (default: the shipped one with the shipped target)")
    parser.add_argument("--closeness-tokens", type=int, default=64, metavar="N",
                        help="where integer products apply: each numerics' top-1 agreement with the fp32 model, "
                        "teacher-forced on the fp32 model's N-token greedy replies to the 13 held-out Spec-Bench "
                        "questions of one per category (0: skip)")


def run(args: argparse.Namespace) -> int:
    from mamba_draft.targets import load_causal_lm

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    dtype = resolve_dtype(args.dtype, "cpu")
    print(f"CPU: {cpu_kind()}; {torch.get_num_threads()} threads; dtype {str(dtype).removeprefix('torch.')}")
    # the target loaded both ways: as transformers loads it, and as `generate` does
    model = load_causal_lm(args.target, dtype=dtype)
    rows = measure(load_plain(args.target, dtype, "cpu"), model, args.repeats)
    print("\n".join(report(rows)))
    table = measure_rows(model, args.repeats)
    if table is None:
        print("\nno rows table: the compiled CPU step does not apply to this target here")
    else:
        print("\nWhat a row costs: the engine's forward over n rows after a 100-token context, the float products "
              "(the model's own, in its dtype) and int8 (--products int8: a GGUF's codes as integers)\n")
        print("\n".join(rows_report(table)))
        drafter = args.drafter or (SHIPPED_TARGET if args.target == SHIPPED_TARGET else None)
        if drafter is not None:
            print("\n".join(drafter_report(measure_drafter_rows(drafter, model, args.repeats))))
        if "int8" in table["ms"] and args.closeness_tokens > 0:
            print("\n".join(closeness_report(args.target, model, dtype, args.closeness_tokens)))
    return 0


@torch.no_grad()
def measure_drafter_rows(path: str, target, repeats: int) -> dict:
    """Median ms of one drafting level (one token per row into a state, reading the target's hidden state where the
    drafter does) over `ROWS` rows: the torch step against the backend `auto` picks, in turns."""
    from mamba_draft import load_drafter

    drafter = load_drafter(path, target=target)
    backends = {"torch": "torch", "auto": getattr(drafter, "backend", "torch")}
    width = target.config.hidden_size if getattr(drafter, "reads_target", False) else 0
    ms = {name: {} for name in backends}
    for n in ROWS:
        state = drafter.allocate_state(n)
        ids = torch.randint(0, drafter.input_vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        features = torch.randn(n, width, dtype=drafter.dtype) if width else None

        def level(backend: str) -> None:
            drafter.set_backend(backend)
            drafter.step(ids, state, features) if width else drafter.step(ids, state)

        for name, t in turns({name: (lambda b=backend: level(b)) for name, backend in backends.items()},
                             repeats).items():
            ms[name][n] = t
    return {"drafter": path, "backend": backends["auto"], "ms": ms}


def drafter_report(table: dict) -> list[str]:
    lines = [f"\nA drafting level of {table['drafter']}: one token per row, torch's step against `auto`'s backend "
             f"({table['backend']})\n", "| rows | torch ms | " + f"{table['backend']} ms | speedup |", "|---|---|---|---|"]
    for n in ROWS:
        mine, torch_ms = table["ms"]["auto"][n], table["ms"]["torch"][n]
        lines.append(f"| {n} | {torch_ms:.2f} | {mine:.2f} | {torch_ms / mine:.2f}x |")
    return lines


def closeness_report(target: str, model, dtype: torch.dtype, tokens: int) -> list[str]:
    """The closeness table (`mamba_draft.benchmarks.closeness`) on the held-out questions, one per category."""
    from mamba_draft.benchmarks import closeness
    from mamba_draft.heldout import SPEC_BENCH
    from mamba_draft.targets import load_causal_lm, load_tokenizer
    from tree_search.prompts import encode_prompt, load_prompts

    tokenizer = load_tokenizer(target)
    prompts = [encode_prompt(tokenizer, p.text) for p in load_prompts(SPEC_BENCH, per_category=1, split="heldout")]
    fp32 = model if dtype == torch.float32 else load_causal_lm(target, dtype=torch.float32)
    found = closeness.agreement(target, prompts, tokens, fp32, load_plain(target, torch.bfloat16, "cpu"), True)
    lines = [f"\nHow close each numerics is to the fp32 model: top-1 agreement at each of {tokens} reply positions, "
             f"teacher-forced on its greedy replies to {len(prompts)} held-out questions\n",
             "| numerics | top-1 agreement with fp32 |", "|---|---|"]
    return lines + [f"| {name} | {rate:.3f} |" for name, rate in found.items()]
