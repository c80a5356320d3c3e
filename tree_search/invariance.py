"""Batch-invariant target forwards: a position's logits must not depend on how many tokens share its forward, or
speculative decoding in low precision drifts from plain decoding of the same model.

Measured on CPUs (bf16, oneDNN; AVX512-BF16, and with ATen/MKL held to AVX2): a one-row matrix product runs another
kernel (a matrix-vector product) than two or more rows, and rounds ~1e-4 of its outputs one bf16 ulp differently;
products of 2, 4, ... 64 rows agree with each other bit for bit, whatever a row's place or its neighbours. The sdpa
CPU kernel rounds with how many masked keys a query's row has, eager attention with where its visible keys sit (a
tree node behind masked siblings). So low-precision CPU targets use row-stable attention
(`mamba_draft.cpu_attention`, each row's visible keys packed to the front) and no target forward multiplies fewer rows
than the *row floor*: a forward of fewer tokens (a plain decoding step) carries dummy leaf rows, which the cache
drops at commit. The floor is probed once per model, dtype and device on the model's own widest linear layer, so a
CPU whose kernels switch at another row count gets its own floor.
"""
from __future__ import annotations

import functools
import weakref

import torch

from tree_search.tree import Tree

_CANDIDATES = (1, 2, 4, 8, 16, 32)  # row counts probed; the reference is a product of _PROBE_ROWS rows
_PROBE_ROWS = 256  # enough single rows that a 1e-4 flip rate shows up (~15 flips expected on a 1536 x 576 layer)
_FLOORS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def low_precision_cpu(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype in (torch.bfloat16, torch.float16)


def row_floor(model: torch.nn.Module) -> int:
    """The fewest rows a target forward must multiply for its per-row results to be those of any larger forward:
    1 for fp32 and off the CPU (fp32 differences are far below a logit tie; GPU batch invariance is another
    matter), else probed on this model's widest linear layer (cached per weights, dtype and device)."""
    if not low_precision_cpu(model):
        return 1
    linear = max((m for m in model.modules() if isinstance(m, torch.nn.Linear)
                  and m is not model.get_output_embeddings()), key=lambda m: m.in_features, default=None)
    if linear is None:
        return 1
    key = (linear.weight.data_ptr(), linear.weight.dtype, linear.weight.device, torch.get_num_threads())
    cached = _FLOORS.setdefault(model, {})
    if key not in cached:
        cached[key] = _probe(linear)
    return cached[key]


@torch.no_grad()
def _probe(linear: torch.nn.Module) -> int:
    """The smallest candidate row count m such that products of m rows, and of every larger candidate, equal the
    reference product of all rows; the reference size if none does. Through the layer itself: the kernel the
    forward runs (a prepacked one, mamba_draft.packed_linear, has the same floor as F.linear where measured)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, linear.in_features, generator=g).to(linear.weight.dtype)
    reference = linear(x)
    floor = _PROBE_ROWS
    for m in sorted(_CANDIDATES, reverse=True):
        chunks = torch.cat([linear(x[i:i + m]) for i in range(0, _PROBE_ROWS, m)])
        if not torch.equal(chunks, reference):
            break
        floor = m
    return floor


@functools.lru_cache(maxsize=256)
def padded(tree: Tree, rows: int) -> Tree:
    """`tree` with dummy leaves under its last node so it has at least `rows` nodes (levels stay sorted; no real
    node sees a dummy, so the real rows' results are those of the tree alone)."""
    extra = rows - len(tree)
    if extra <= 0:
        return tree
    return Tree(tree.parents + (len(tree) - 1,) * extra)
