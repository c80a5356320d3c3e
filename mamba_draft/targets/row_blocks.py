"""Row-invariant linear layers for CPU targets: every product is computed in blocks of exactly R rows (the last
zero-padded), so a row's result does not depend on how many rows share its forward (why: docs/benchmarks.md, "Exact
on every CPU kind"). R is chosen per machine by cost (`choose_rows`), checked position-free on every layer shape
(`_position_free`; R = 1 is the fallback) and kept per CPU, torch build, threads and shapes.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from ..devices import cpu_info
from ..io import cache_root, write_json


CANDIDATES = (1, 2, 4, 8, 16)  # block sizes tried for decoding and verification forwards
PREFILL_ROWS = 64  # the block of a prompt's prefill: near a large product's cost per row on every kind measured
WORKLOAD = (1, 4, 9)  # forwards the CPU engine runs most: a decoding step, a small tree, a prompt-lookup round
STEP_SLACK = 1.2  # a block may cost at most this much more than the cheapest one (a one-token step's products)
ROWS_ENV = "MAMBA_DRAFT_ROW_BLOCK"  # force R (tests, kernel sweeps); otherwise chosen by cost


class RowBlocks:
    """Mixed into a row-wise layer's own class (nn.Linear, a prepacked one, transformers' Conv1D, any subclass):
    its inference multiplies exactly `rows` rows per product through the layer's own forward. The parameters,
    state dict, hooks and isinstance checks are the layer's; with gradients on (training), a plain product."""

    rows: int  # the block of decoding and verification forwards
    prefill_rows: int  # the block of prefills (PREFILL_ROWS where position-free, else `rows`)
    block: int  # the block of the forward running now: `rows`, or `prefill_rows` inside `prefilling`
    _pad: torch.Tensor | None  # (block, in_features): the last block's input, reused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        n = x.numel() // features
        block = self.block
        # one call for a prefill's blocks and trees that fill a block; a plain product for training
        if n == block or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        pad = self._pad
        if pad is None or pad.shape[0] != block or pad.dtype != x.dtype or pad.device != x.device:
            pad = self._pad = x.new_zeros(block, features)
        flat = x.reshape(n, features)
        whole = n - n % block
        blocks = [super(RowBlocks, self).forward(flat[i:i + block]) for i in range(0, whole, block)]
        if whole < n:  # the rest in one padded block (a decoding step, a small tree: all of it)
            pad[: n - whole].copy_(flat[whole:])  # rows past them may hold an earlier call's: no row reads another
            blocks.append(super(RowBlocks, self).forward(pad)[: n - whole])
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # one block: no copy on the decoding path
        return out.view(*x.shape[:-1], -1)

    def _apply(self, fn, recurse=True):  # .to() / .float(): the padding buffer follows on the next call
        self._pad = None
        return super()._apply(fn, recurse)


@functools.cache
def _blocked(cls: type) -> type:
    """The class `cls` with RowBlocks mixed in (one per layer class)."""
    return type(f"RowBlocked{cls.__name__}", (RowBlocks, cls), {"__module__": __name__})


def _row_wise(module: nn.Module) -> bool:
    """Layers whose forward maps (..., in) to (..., out) one row at a time through a matrix product."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D"
                                             and type(module).__module__.startswith("transformers"))


def unblocked_forward(layer: nn.Module):
    """The layer's own product, without row blocks."""
    return super(RowBlocks, layer).forward if isinstance(layer, RowBlocks) else layer.forward


def row_block(model: nn.Module) -> int | None:
    """R when every row-wise layer of `model` multiplies in blocks of R rows, else None."""
    sizes = {m.rows if isinstance(m, RowBlocks) else None for m in model.modules() if _row_wise(m)}
    return sizes.pop() if len(sizes) == 1 else None


def low_precision_cpu(model: nn.Module) -> bool:
    """Whether `model`'s row-wise layers are bf16/fp16 on a CPU: where a row count's rounding flips greedy choices
    (fp32 moves the last of 24 bits, and blocks there cost a memory-bound product a weight pass per block)."""
    layer = next((m for m in model.modules() if _row_wise(m)), None)
    return layer is not None and layer.weight.device.type == "cpu" and layer.weight.dtype in (torch.bfloat16,
                                                                                              torch.float16)


def make_row_invariant(model: nn.Module, rows: int | None = None) -> int:
    """Put every row-wise layer of a CPU `model` in blocks of R rows, in place (idempotent: a model already in
    blocks keeps its R unless another is asked); returns R. `rows` None: $MAMBA_DRAFT_ROW_BLOCK, else
    `choose_rows`. Models off the CPU are left as they are (returns 1: GPU kernels are another matter)."""
    layers = [m for m in model.modules() if _row_wise(m)]
    if not layers or layers[0].weight.device.type != "cpu":
        return 1
    current = row_block(model)
    if rows is None:
        rows = current or _forced_rows() or choose_rows(model)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"a row block needs a positive number of rows, got {rows!r}")
    if current == rows:
        return rows
    prefill = PREFILL_ROWS if all(_position_free(m, PREFILL_ROWS) for m in _shapes(model).values()) else rows
    for layer in layers:
        if not isinstance(layer, RowBlocks):
            layer.__class__ = _blocked(type(layer))
        layer.rows = layer.block = rows
        layer.prefill_rows, layer._pad = prefill, None
    return rows


@contextlib.contextmanager
def prefilling(model: nn.Module):
    """Inside, `model`'s row-blocked layers multiply in blocks of their `prefill_rows` instead of `rows`: every path
    the engine compares computes a prompt by a prefill, so prefills need only agree with each other, and large
    blocks spare a long prompt re-reading every weight n / R times."""
    layers = [m for m in model.modules() if isinstance(m, RowBlocks)]
    for layer in layers:
        layer.block = layer.prefill_rows
    try:
        yield
    finally:
        for layer in layers:
            layer.block = layer.rows


def _forced_rows() -> int | None:
    value = os.environ.get(ROWS_ENV)
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f"{ROWS_ENV} must be a positive number of rows, got {value!r}")
    return int(value) if value else None


def _shapes(model: nn.Module) -> dict[tuple, nn.Module]:
    """The first of the model's row-wise layers for each key of what a product's cost and kernel depend on."""
    groups: dict[tuple, nn.Module] = {}
    for m in filter(_row_wise, model.modules()):
        key = (isinstance(m, nn.Linear), tuple(m.weight.shape), getattr(m, "bias", None) is not None,
               str(m.weight.dtype))
        groups.setdefault(key, m)
    return groups


def _in_features(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.weight.shape[0]  # Conv1D: (in, out)


@torch.no_grad()
def block_costs(model: nn.Module, candidates=CANDIDATES, repeats: int = 5) -> dict[int, float]:
    """Seconds one product of R rows through every row-wise layer of `model`, in the model's order, takes per
    candidate R: a forward's worth of products, so each weight comes from memory as in a real forward. Candidates
    interleaved, the fastest of `repeats` kept, so a busy machine slows every candidate alike."""
    layers = [(unblocked_forward(m), m) for m in model.modules() if _row_wise(m)]
    inputs = {rows: {key: torch.randn(rows, key[0]).to(key[1])
                     for key in {(_in_features(m), m.weight.dtype) for _, m in layers}} for rows in candidates}
    best = dict.fromkeys(candidates, float("inf"))
    for repeat in range(repeats + 1):  # the first round warms up (packing, first touch) and is not kept
        for rows in candidates:
            xs = inputs[rows]
            start = time.perf_counter()
            for product, m in layers:
                product(xs[_in_features(m), m.weight.dtype])
            if repeat:
                best[rows] = min(best[rows], time.perf_counter() - start)
    return best


def pick_rows(costs: dict[int, float], workload=WORKLOAD, slack: float = STEP_SLACK) -> int:
    """The block size with the least time over `workload` (a forward of n rows costs ⌈n/R⌉ blocks) among those
    whose one block costs at most `slack` × the cheapest block: a one-token decoding step never gets dearer than
    the cheapest product allows, and trees get the rows that come nearly free."""
    cheapest = min(costs.values())
    allowed = [r for r, c in costs.items() if c <= slack * cheapest]
    return min(allowed, key=lambda r: (sum(-(-n // r) for n in workload) * costs[r], -r))


@torch.no_grad()
def _position_free(layer: nn.Module, rows: int) -> bool:
    """Whether, in products of `rows` rows, a row's result is the same bits at every place in the block and beside
    any other rows (random neighbours, or zeros): the assumption row blocks rest on."""
    if rows == 1:
        return True
    product = unblocked_forward(layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, _in_features(layer), generator=g).to(layer.weight.dtype)
    reference = product(x)
    shifted = product(x.roll(1, 0)).roll(-1, 0)
    others = torch.randn(rows, _in_features(layer), generator=g).to(layer.weight.dtype)
    for place in (0, rows - 1):
        for neighbours in (torch.zeros_like(x), others):  # the row alone among zeros, then beside random rows
            block = neighbours.clone()
            block[place] = x[0]
            if not torch.equal(product(block)[place], reference[0]):
                return False
    return torch.equal(shifted, reference)


def choose_rows(model: nn.Module) -> int:
    """R for this model on this machine: kept from an earlier choice (same CPU, torch, threads and layer shapes),
    else `pick_rows` over `block_costs`, falling back to smaller blocks where a layer's rows are not position-free
    (R = 1 always is), and kept."""
    groups = _shapes(model)
    key = _machine_key(groups)
    root = cache_root()
    store = None if root is None else root / "row_blocks.json"
    kept = _read(store).get(key)
    if isinstance(kept, int) and kept in CANDIDATES:
        return kept
    costs = block_costs(model)
    while True:
        rows = pick_rows(costs)
        if rows == 1 or all(_position_free(layer, rows) for layer in groups.values()):
            break
        costs.pop(rows)
    if store is not None:
        with contextlib.suppress(OSError):  # best effort; atomic: a reader sees the old file or the new one
            write_json(store, {**_read(store), key: rows})
    return rows


def _machine_key(groups: dict) -> str:
    """What the choice depends on: the CPU (model name and flags), torch build, threads, and the layer shapes."""
    cpu = cpu_info("model name") or platform.processor() or platform.machine()
    identity = [cpu, cpu_info("flags"), torch.__version__, torch.get_num_threads(), sorted(map(list, groups))] + [
        os.environ.get(name, "") for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                              "MKL_CBWR")]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]


def _read(path: Path | None) -> dict:
    """The choices kept at `path`: empty without one, or where it is unreadable or not a JSON object."""
    data = None
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
