"""Row-stable attention: a query's output does not depend on where its visible keys sit in the forward.

Low-precision CPU kernels reduce with SIMD lanes, so a softmax or a probability-weighted sum of values rounds with
the positions of the terms: a tree node whose ancestors sit behind masked siblings rounds differently from the
decoding step that computes the same token after the same context, and speculative output in bf16 drifts from plain
decoding (tree_search.invariance). Here every query row first gathers its visible keys to the front, in order, so
each row reduces over [context..., itself] exactly as a decoding step does, whatever the tree; the query heads that
share a key head multiply together (>= 2 rows for GQA models, the same kernel in every forward).

Forwards of more than `GATHER_MAX_QUERIES` queries (prefills) and unmasked ones run plain eager attention: the
gather costs memory per query, and a prefill is computed the same way for every method that shares it.
Registered with transformers as attn_implementation="row_stable" (`mamba_draft.targets.default_attention` picks it
for bf16/fp16 targets on CPU).
"""
from __future__ import annotations

import torch

NAME = "row_stable"
GATHER_MAX_QUERIES = 64


def _eager(query, key, value, attention_mask, scaling):
    """transformers' eager attention (repeat the key heads, additive mask, fp32 softmax) -> (B, q, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def row_stable_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """query (B, H, q, D), key/value (B, KVH, K, D), attention_mask (B, 1, q, K) additive or boolean
    -> ((B, q, H, D), None)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_mask is None or query.shape[2] > GATHER_MAX_QUERIES:
        return _eager(query, key, value, attention_mask, scaling), None
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    mask = attention_mask[:, 0, :, :keys]
    visible = mask if mask.dtype == torch.bool else mask == 0
    count = visible.sum(-1)  # (B, q)
    width = max(1, int(count.max()))
    # visible keys first, in position order (a stable sort of "masked?"), then the masked tail
    order = torch.sort((~visible).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    index = order[:, None, :, :, None].expand(batch, kv_heads, queries, width, dim)
    k = key[:, :, None].expand(batch, kv_heads, queries, keys, dim).gather(3, index)
    v = value[:, :, None].expand(batch, kv_heads, queries, keys, dim).gather(3, index)
    q = query.view(batch, kv_heads, heads // kv_heads, queries, dim).transpose(2, 3)  # (B, KVH, q, G, D)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (B, KVH, q, G, width)
    tail = torch.arange(width, device=query.device) >= count[..., None]  # (B, q, width)
    scores = scores.masked_fill(tail[:, None, :, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, v)  # (B, KVH, q, G, D)
    return out.transpose(2, 3).reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make attn_implementation="row_stable" known to transformers, with eager's explicit masks (sdpa's mask
    builder may hand a causal prefill no mask at all); idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, row_stable_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME
