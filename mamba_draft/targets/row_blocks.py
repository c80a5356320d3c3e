"""Row-invariant linear layers for CPU targets: every product is computed in blocks of a fixed set of row counts
(the last block zero-padded), so a row's result does not depend on how many rows share its forward (why:
docs/benchmarks.md, "Exact on every CPU kind").

A CPU library picks its kernel, and with it a dot product's rounding, by the product's shape. For one row count R a
row's bits are the same wherever it sits in the block and whatever rows sit beside it; on some kinds several row
counts share one kernel and give the same bits (AMD's AVX512-BF16 path: every count from 2 up). The blocks are a
*ladder* of such counts, ascending: a forward of n rows uses the smallest count that holds them, or blocks of the
largest. The ladder is chosen per machine by cost (`choose_sizes`), every count checked position-free and every pair
checked to agree on every layer shape, and kept per CPU, torch build, threads and shapes.
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
WORKLOAD = (1, 4, 9, 16)  # forwards the CPU engine runs: a decoding step, small and large trees, a lookup round
STEP_SLACK = 1.2  # a ladder's smallest block may cost at most this much more than the cheapest block
ROWS_ENV = "MAMBA_DRAFT_ROW_BLOCK"  # force the ladder, e.g. "8" or "2,4,8,16" (tests, kernel sweeps)


class RowBlocks:
    """Mixed into a row-wise layer's own class (nn.Linear, a prepacked one, transformers' Conv1D, any subclass):
    its inference multiplies its rows in blocks of the counts in `sizes` only, through the layer's own forward. The
    parameters, state dict, hooks and isinstance checks are the layer's; with gradients on (training), or inside
    `exact.prefilling` (`active` None), a plain product."""

    sizes: tuple[int, ...]  # the ladder of decoding and verification forwards, ascending
    active: tuple[int, ...] | None  # the ladder of the forward running now: `sizes`, or None in a prefill
    _pads: dict  # block size -> (size, in_features) input of a padded block, reused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        n = x.numel() // features
        sizes = self.active
        if sizes is None or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        flat = x.reshape(n, features)  # every block a 2-D product, as `agreeing_classes` probes it (a 3-D input
        if n in sizes:                 # of one row may take another kernel: a matrix-vector one)
            return super().forward(flat).view(*x.shape[:-1], -1)
        largest = sizes[-1]
        whole = n - n % largest
        blocks = [super(RowBlocks, self).forward(flat[i:i + largest]) for i in range(0, whole, largest)]
        if whole < n:  # the rest in one block of the smallest size that holds it, padded
            size = next(s for s in sizes if s >= n - whole)
            pad = self._pads.get(size)
            if pad is None or pad.dtype != x.dtype or pad.device != x.device:
                pad = self._pads[size] = x.new_zeros(size, features)
            pad[: n - whole].copy_(flat[whole:])  # rows past them may hold an earlier call's: no row reads another
            blocks.append(super(RowBlocks, self).forward(pad)[: n - whole])
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # one block: no copy on the decoding path
        return out.view(*x.shape[:-1], -1)

    def _apply(self, fn, recurse=True):  # .to() / .float(): the padding buffers follow on the next call
        self._pads = {}
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
    return super(RowBlocks, layer).forward if isinstance(layer, RowBlocks) else layer.forward


def row_block(model: nn.Module) -> tuple[int, ...] | None:
    """The ladder when every row-wise layer of `model` multiplies in blocks of it, else None."""
    ladders = {m.sizes if isinstance(m, RowBlocks) else None for m in model.modules() if _row_wise(m)}
    return ladders.pop() if len(ladders) == 1 else None


def low_precision_cpu(model: nn.Module) -> bool:
    """Whether `model`'s row-wise layers are bf16/fp16 on a CPU: where a row count's rounding flips greedy choices
    (fp32 moves the last of 24 bits, and blocks there cost a memory-bound product a weight pass per block)."""
    layer = next((m for m in model.modules() if _row_wise(m)), None)
    return layer is not None and layer.weight.device.type == "cpu" and layer.weight.dtype in (torch.bfloat16,
                                                                                              torch.float16)


def make_row_invariant(model: nn.Module, rows: int | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Put every row-wise layer of a CPU `model` in row blocks, in place (idempotent: a model already in blocks keeps
    its ladder unless another is asked); returns the ladder. `rows` (a count or a ladder) None: $MAMBA_DRAFT_ROW_BLOCK,
    else `choose_sizes`. Models off the CPU are left as they are (returns (1,): GPU kernels are another matter)."""
    layers = [m for m in model.modules() if _row_wise(m)]
    if not layers or layers[0].weight.device.type != "cpu":
        return (1,)
    current = row_block(model)
    if rows is None:
        rows = current or _forced_sizes() or choose_sizes(model)
    sizes = (rows,) if isinstance(rows, int) and not isinstance(rows, bool) else tuple(rows)
    if not sizes or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in sizes):
        raise ValueError(f"row blocks need positive numbers of rows, got {rows!r}")
    sizes = tuple(sorted(set(sizes)))
    if current == sizes:
        return sizes
    for layer in layers:
        if not isinstance(layer, RowBlocks):
            layer.__class__ = _blocked(type(layer))
        layer.sizes = layer.active = sizes
        layer._pads = {}
    return sizes


def _forced_sizes() -> tuple[int, ...] | None:
    value = os.environ.get(ROWS_ENV, "")
    parts = [p.strip() for p in value.split(",")] if value else []
    if any(not p.isdigit() or int(p) < 1 for p in parts):
        raise ValueError(f"{ROWS_ENV} must be positive numbers of rows separated by commas, got {value!r}")
    return tuple(sorted({int(p) for p in parts})) or None


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


def forward_cost(costs: dict[int, float], sizes: tuple[int, ...], n: int) -> float:
    """What a forward of n rows costs in blocks of the ladder `sizes`: blocks of the largest, the rest in one."""
    largest = sizes[-1]
    whole, rest = divmod(n, largest)
    return whole * costs[largest] + (costs[next(s for s in sizes if s >= rest)] if rest else 0.0)


def pick_sizes(costs: dict[int, float], classes: list[tuple[int, ...]], workload=WORKLOAD,
               slack: float = STEP_SLACK) -> tuple[int, ...]:
    """Among `classes` (ladders whose counts give a row the same bits), the one with the least time over `workload`
    whose smallest block costs at most `slack` × the cheapest block: a one-token decoding step never gets dearer than
    the cheapest product allows, and trees get the rows that come nearly free."""
    cheapest = min(costs.values())
    allowed = [c for c in classes if costs[c[0]] <= slack * cheapest] or [min(classes, key=lambda c: costs[c[0]])]
    return min(allowed, key=lambda c: (sum(forward_cost(costs, c, n) for n in workload), -c[-1]))


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


@torch.no_grad()
def _blocked_rows(layer: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """Every row of x through `layer`'s own product in blocks of `rows` (the last zero-padded)."""
    product, n = unblocked_forward(layer), x.shape[0]
    padded = torch.cat([x, x.new_zeros(-n % rows, x.shape[1])])
    return torch.cat([product(padded[i:i + rows]) for i in range(0, padded.shape[0], rows)])[:n]


def agreeing_classes(groups: dict, sizes) -> list[tuple[int, ...]]:
    """`sizes` split into ladders whose blocks give every row the same bits on every layer shape of `groups`. One
    row stays alone: libraries multiply it by a matrix-vector kernel of its own, which a probe can find agreeing
    on random rows and a real forward then not (seen with ATen's scalar kernels and oneDNN's emulated bf16)."""
    g = torch.Generator().manual_seed(1)
    probes = {key: torch.randn(19, _in_features(layer), generator=g).to(layer.weight.dtype)
              for key, layer in groups.items()}
    classes: list[tuple[list[int], list[torch.Tensor]]] = []
    for rows in sizes:
        outputs = [_blocked_rows(layer, probes[key], rows) for key, layer in groups.items()]
        same = None if rows == 1 else next((c for c in classes if c[0][0] > 1 and all(map(torch.equal, c[1], outputs))),
                                           None)
        if same is None:
            classes.append(([rows], outputs))
        else:
            same[0].append(rows)
    return [tuple(c[0]) for c in classes]


def choose_sizes(model: nn.Module) -> tuple[int, ...]:
    """The ladder for this model on this machine: kept from an earlier choice (`_machine_key`), else `pick_sizes`
    over `block_costs` among the position-free counts grouped by `agreeing_classes`, and kept."""
    groups = _shapes(model)
    key = _machine_key(groups)
    root = cache_root()
    store = None if root is None else root / "row_blocks.json"
    kept = _read(store).get(key)
    if isinstance(kept, list) and kept and all(r in CANDIDATES for r in kept) and (len(kept) == 1 or 1 not in kept):
        return tuple(kept)
    costs = block_costs(model)
    free = [rows for rows in CANDIDATES if all(_position_free(layer, rows) for layer in groups.values())]
    sizes = pick_sizes({r: costs[r] for r in free}, agreeing_classes(groups, free))
    if store is not None:
        with contextlib.suppress(OSError):  # best effort; atomic: a reader sees the old file or the new one
            write_json(store, {**_read(store), key: list(sizes)})
    return sizes


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
