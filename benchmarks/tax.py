"""The exactness tax: what the exact target path (`load_causal_lm` + the engine's `TargetCache`) costs against
transformers' plain model (sdpa, no packing, no row blocks) on this machine, side by side in one run.

    mamba-draft tax [--target smollm2] [--dtype auto|bfloat16|float32] [--repeats 25]

Prints the CPU (model name and the flags that pick its kernels), the dtype, and per forward (a decoding step and the
verification of 4 and 16 tokens after a 100-token context, prefills of 64 and 768 tokens) the median milliseconds of
both paths, timed in turns, and their ratio. `--dtype bfloat16` measures the bf16 tax on a CPU without native bf16.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.methods import load_plain, timed
from mamba_draft.devices import cpu_info, resolve_dtype
from mamba_draft.dtypes import DTYPES

CONTEXT = 100  # tokens cached before a decoding or verification forward
FORWARDS = (("step", 1), ("verify", 4), ("verify", 16), ("prefill", 64), ("prefill", 768))
KERNEL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_kind() -> str:
    flags = set(cpu_info("flags").split())
    return f"{cpu_info('model name') or 'unknown CPU'} ({' '.join(f for f in KERNEL_FLAGS if f in flags) or 'no AVX'})"


class PlainPath:
    """transformers' own forward over a DynamicCache, as its `generate` runs it."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        from mamba_draft.targets import cache_keyword

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

    def __init__(self, model, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        self.kept = None  # the static cache, reused by every prefill as a SpeculativeDecoder reuses it

    def prefill(self, ids: torch.Tensor):
        from mamba_draft.targets.cache import TargetCache

        self.kept = cache = TargetCache.for_call(self.model, self.max_len, kept=self.kept)
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
        times = {name: [] for name in calls}
        for _ in range(repeats + 2):
            for name, call in calls.items():
                times[name].append(timed(call, ids.device)[1])
        # two warm-up turns (packing, first touch, a grown cache)
        ms = {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}
        rows.append({"forward": kind, "tokens": n, **ms, "ratio": ms["exact"] / ms["plain"]})
    return rows


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


def run(args: argparse.Namespace) -> int:
    from mamba_draft.targets import load_causal_lm

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    dtype = resolve_dtype(args.dtype, "cpu")
    print(f"CPU: {cpu_kind()}; {torch.get_num_threads()} threads; dtype {str(dtype).removeprefix('torch.')}")
    # the target loaded both ways: as transformers loads it, and as `generate` does
    rows = measure(load_plain(args.target, dtype, "cpu"), load_causal_lm(args.target, dtype=dtype), args.repeats)
    print("\n".join(report(rows)))
    return 0
