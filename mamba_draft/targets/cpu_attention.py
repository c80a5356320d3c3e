"""Attention for CPU targets: grouped (key heads never repeated) and row-stable (trees round as decoding does).

`grouped_attention` is eager's arithmetic (additive mask, fp32 softmax) with the G query heads of a key head
multiplied together, where transformers repeats every key/value head (on a CPU, a copy of the KV cache per layer and
step). `row_stable_attention` also makes a query's output independent of what else shares its forward: low-precision
CPU kernels round a sum with the positions of its terms, so a tree node behind masked siblings would round otherwise
than the decoding step computing the same token (why that matters: `row_blocks`). Registered with transformers as
attn_implementation "grouped" and "row_stable" (`register`).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

GROUPED, ROW_STABLE = "grouped", "row_stable"
GATHER_MAX_QUERIES = 64
BLOCK = 64  # keys per block of a row-stable sum
ITEMS = 32  # products per bmm call (_items): one fixed call shape
LOOP_SUM_MIN = 1 << 14  # elements per block sum above which blocks are added in a loop (_blocks_sum)
CHUNK = 128  # query rows per product in a long forward (a prefill): bounds memory, skips keys no row of it sees
# A hidden key's bias: the lowest float, as eager's masks, not -inf: the same exact zero after the softmax, but a row
# that sees no key (a left pad's query) gets finite weights, not NaNs that would reach every row in the next layer.
HIDDEN = torch.finfo(torch.float32).min


def _scaling(query: torch.Tensor, scaling: float | None) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """query (B, H, q, D), key/value (B, KVH, K, D), attention_mask (B, 1, q, K) additive or boolean, or None
    -> ((B, q, H, D), None)."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * queries, dim)  # heads h = kv * G + g: a view when contiguous
    scores = (torch.matmul(q, key.transpose(-1, -2)) * _scaling(query, scaling)).view(
        batch, kv_heads, groups, queries, keys)
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :keys]  # (B, 1, 1, q, K)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, groups * queries, keys), value)
    return out.view(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class _Contiguous:
    """Every row sees one run of keys, [start_b, start_b + n_row) (causal prefills, chains, decoding steps; start_b
    > 0 behind left padding): a row's logical keys are physical ones shifted by start_b, no gather needed."""
    starts: tuple[int, ...] | None  # per batch row, None when all are 0
    bias: torch.Tensor              # (B, 1, q, whole blocks) float32: 0 where visible, HIDDEN elsewhere
    chunks: tuple[tuple[int, int, int], ...]  # (first row, stop row, keys the rows see, in whole blocks)


@dataclass(frozen=True)
class _Gathered:
    """Rows with gaps (tree nodes behind masked siblings): `index` (B, q, width) lists each row's visible keys in
    position order, the first `full` blocks (keys every row sees) identical in every row, padded with key 0."""
    full: int
    index: torch.Tensor  # (B, q, (full + own blocks) * BLOCK) long
    bias: torch.Tensor   # same shape, float32: 0 for a real key, HIDDEN for padding


_last: tuple[weakref.ref, int, tuple, object] | None = None  # one forward's layout serves its every layer


def _layout(attention_mask: torch.Tensor | None, batch: int, queries: int, keys: int, device):
    """Where each query row's logical keys sit (cached for the mask object and version that made it)."""
    global _last
    shape = (batch, queries, keys)
    if attention_mask is not None and _last is not None and _last[0]() is attention_mask \
            and _last[1] == attention_mask._version and _last[2] == shape:
        return _last[3]
    if attention_mask is None:
        visible = torch.ones(batch, queries, keys, dtype=torch.bool, device=device)
    else:
        mask = attention_mask[:, 0, :, :keys]
        visible = mask if mask.dtype == torch.bool else mask == 0  # (B, q, K)
    blocks = -(-keys // BLOCK)
    starts = visible.any(1).int().argmax(-1).tolist()  # first key any row of the batch row sees
    shifted = torch.stack([visible[b].roll(-s, dims=-1) for b, s in enumerate(starts)]) if any(starts) else visible
    if not (shifted[..., 1:] & ~shifted[..., :-1]).any():  # every row: a run of visible keys, then hidden ones
        bias = torch.zeros(batch, 1, queries, blocks * BLOCK, device=device)
        bias[:, 0, :, :keys].masked_fill_(~shifted, HIDDEN)
        bias[..., keys:] = HIDDEN
        # a causal prefill's early rows see only the early keys: each chunk of rows multiplies only the blocks its
        # rows see (whole blocks: what a row's sum adds beyond its own keys is exact zeros either way)
        seen = shifted.sum(-1).amax(0)  # (q,) keys the row sees, at most, over the batch
        chunks = tuple((first, min(first + CHUNK, queries),
                        max(1, -(-int(seen[first:first + CHUNK].max()) // BLOCK)) * BLOCK)
                       for first in range(0, queries, CHUNK))
        layout = _Contiguous(tuple(starts) if any(starts) else None, bias, chunks)
    elif queries > GATHER_MAX_QUERIES:
        layout = None  # a long forward with gaps: no method runs one (a prefill is causal); grouped attention
    else:
        shared = int(visible.all(dim=1).all(dim=0).long().cumprod(0).sum())  # leading keys every row sees
        full = max(0, shared - 1) // BLOCK  # (each row keeps >= 1 key of its own)
        base = full * BLOCK
        own = visible[..., base:]
        count = own.sum(-1)  # (B, q)
        width = max(1, -(-int(count.max()) // BLOCK)) * BLOCK
        order = torch.sort((~own).to(torch.uint8), dim=-1, stable=True).indices + base  # visible first, in order
        order = torch.nn.functional.pad(order, (0, max(0, width - order.shape[-1])))[..., :width]
        head = torch.arange(base, device=device).expand(batch, queries, base)
        valid = torch.cat([torch.ones_like(head, dtype=torch.bool),
                           torch.arange(width, device=device) < count[..., None]], dim=-1)
        layout = _Gathered(full, torch.cat([head, order], dim=-1),
                           torch.zeros(valid.shape, device=device).masked_fill_(~valid, HIDDEN))
    if attention_mask is not None:
        _last = (weakref.ref(attention_mask), attention_mask._version, shape, layout)
    return layout


def _items(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """A batch of small products, left (..., M, K) @ right (..., K, N) broadcast over the leading dims, run as
    `bmm` calls of exactly ITEMS contiguous products each (the last call zero-padded): a library picks its kernel,
    and so its rounding, by the whole call, so fixed calls give a product the same bits wherever it sits."""
    batch = tuple(max(a, b) for a, b in zip(left.shape[:-2], right.shape[:-2]))  # same rank, sizes equal or 1
    (m, k), n = left.shape[-2:], right.shape[-1]
    count = math.prod(batch)
    padded = -(-count // ITEMS) * ITEMS
    lefts, rights = left.new_empty(padded, m, k), right.new_empty(padded, k, n)
    lefts[:count].view(*batch, m, k).copy_(left)  # one copy each: broadcast, made contiguous, in place
    rights[:count].view(*batch, k, n).copy_(right)
    lefts[count:].zero_()
    rights[count:].zero_()
    out = left.new_empty(padded, m, n)
    for i in range(0, padded, ITEMS):
        torch.bmm(lefts[i:i + ITEMS], rights[i:i + ITEMS], out=out[i:i + ITEMS])
    return out[:count].view(*batch, m, n)


def _per_block(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left (B, KVH, n, nb, M, K) @ right, blocks shared by the rows (B, KVH, nb, K, N) or one set per row (B, KVH,
    n, nb, K, N) -> (B, KVH, n, nb, M, N): one product per query row and block (scores: G queries x a key block;
    outputs: G rows of weights x a value block), so a row's sum is computed alike whatever else shares the forward."""
    return _items(left, right if right.dim() == left.dim() else right[:, :, None])


def _softmax(scores: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scores (B, KVH, n, nb, G, BLOCK) + bias (B, 1, n, nb * BLOCK), float32 softmax over each row's blocks in
    order (a trailing hidden block adds exact zeros) -> probs in `dtype`, same shape as scores."""
    batch, kv_heads, n, blocks, groups, _ = scores.shape
    scores = scores + bias.view(batch, 1, n, blocks, 1, BLOCK)
    flat = scores.permute(0, 1, 2, 4, 3, 5).reshape(batch, kv_heads, n, groups, blocks * BLOCK)
    probs = torch.softmax(flat, dim=-1).to(dtype)
    return probs.view(batch, kv_heads, n, groups, blocks, BLOCK).transpose(3, 4)


def _blocks_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts (B, KVH, n, nb, G, D) -> their sum over blocks (B, KVH, n, G, D) float32, added in block order in
    float64 (a block that is all padding adds an exact 0), as a CPU cumsum accumulates: small sums take one cumsum,
    large ones (a prefill's) a loop of in-place adds, faster there and the same bits (tests/test_cpu_attention.py)."""
    if parts[:, :, :, 0].numel() < LOOP_SUM_MIN:
        return torch.cumsum(parts, 3, dtype=torch.float32)[:, :, :, -1]
    total = parts[:, :, :, 0].double()
    for block in range(1, parts.shape[3]):
        total += parts[:, :, :, block]
    return total.float()


def _blocks(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, KVH, K, D) -> its first `width` rows (zero-padded past K) as blocks (B, KVH, width / BLOCK, BLOCK, D)."""
    batch, kv_heads, keys, dim = x.shape
    x = torch.nn.functional.pad(x[:, :, :min(width, keys)], (0, 0, 0, max(0, width - keys)))
    return x.view(batch, kv_heads, width // BLOCK, BLOCK, dim)


def _contiguous(layout: _Contiguous, q, key, value, scaling):
    """q (B, KVH, q, G, D) -> outputs (B, KVH, q, G, D) float32, rows seeing one run of keys."""
    if layout.starts is not None:  # left padding: each batch row's keys from its first visible one
        key, value = (torch.stack([x[b].roll(-s, dims=-2) for b, s in enumerate(layout.starts)]) for x in (key, value))
    widest = max(width for _, _, width in layout.chunks)  # pad once; each chunk views its blocks
    keys, values = _blocks(key, widest), _blocks(value, widest)
    outs = []
    for first, stop, width in layout.chunks:
        blocks = width // BLOCK
        scores = _per_block(q[:, :, first:stop, None], keys[:, :, :blocks].transpose(-1, -2)) * scaling
        probs = _softmax(scores, layout.bias[:, :, first:stop, :width], value.dtype)
        outs.append(_blocks_sum(_per_block(probs, values[:, :, :blocks])))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _gathered(layout: _Gathered, q, key, value, scaling):
    """As `_contiguous`, for rows with gaps."""
    batch, kv_heads, queries, _, dim = q.shape
    full, width = layout.full, layout.index.shape[-1]
    base = full * BLOCK
    own = layout.index[:, :, base:]  # (B, q, own blocks * BLOCK): each row's keys past the shared blocks, in order

    def gather(x):  # (B, KVH, K, D) -> each row's own blocks (B, KVH, q, own blocks, BLOCK, D); whole rows of D
        rows = torch.stack([x[b].index_select(1, own[b].flatten()) for b in range(batch)])
        return rows.view(batch, kv_heads, queries, -1, BLOCK, dim)

    scores = _per_block(q[:, :, :, None], gather(key).transpose(-1, -2))
    if full:  # the blocks every row sees, read in place
        scores = torch.cat([_per_block(q[:, :, :, None], _blocks(key, base).transpose(-1, -2)), scores], dim=3)
    probs = _softmax(scores * scaling, layout.bias.view(batch, 1, queries, width), value.dtype)
    parts = _per_block(probs[:, :, :, full:], gather(value))
    if full:
        parts = torch.cat([_per_block(probs[:, :, :, :full], _blocks(value, base)), parts], dim=3)
    return _blocks_sum(parts)


def row_stable_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """As `grouped_attention`, but every sum over keys runs over each query row's visible keys in position order,
    in blocks of `BLOCK` (a trailing masked term adds an exact 0), one product per block added block after block.
    Rows that see one run of keys use the keys in place; rows with gaps (tree nodes) gather their own blocks."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    layout = _layout(attention_mask, batch, queries, key.shape[2], query.device)
    if layout is None:
        return grouped_attention(module, query, key, value, attention_mask, scaling)
    q = query.view(batch, kv_heads, heads // kv_heads, queries, dim).transpose(2, 3)  # (B, KVH, q, G, D)
    run = _contiguous if isinstance(layout, _Contiguous) else _gathered
    out = run(layout, q, key, value, _scaling(query, scaling)).to(query.dtype)
    return out.transpose(1, 2).reshape(batch, queries, heads, dim), None


def register(name: str = ROW_STABLE) -> str:
    """Make attn_implementation=`name` ("grouped" or "row_stable") known to transformers, with eager's explicit
    masks (sdpa's mask builder may hand a causal prefill no mask at all); idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    functions = {GROUPED: grouped_attention, ROW_STABLE: row_stable_attention}
    AttentionInterface.register(name, functions[name])
    AttentionMaskInterface.register(name, eager_mask)
    return name
