"""Grouped attention for CPU batch generation: eager's arithmetic (additive mask, fp32 softmax) with the G query heads
of a key head multiplied together, where transformers repeats every key/value head (on a CPU, a copy of the KV cache
per layer and step). Registered with transformers as attn_implementation "grouped" (`register`).
"""
from __future__ import annotations

import torch

GROUPED = "grouped"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """query (B, H, q, D), key/value (B, KVH, K, D), attention_mask (B, 1, q, K) additive or boolean, or None
    -> ((B, q, H, D), None)."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * queries, dim)  # heads h = kv * G + g: a view when contiguous
    scale = dim ** -0.5 if scaling is None else scaling
    scores = (torch.matmul(q, key.transpose(-1, -2)) * scale).view(batch, kv_heads, groups, queries, keys)
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :keys]  # (B, 1, 1, q, K)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
            else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, groups * queries, keys), value)
    return out.view(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make attn_implementation "grouped" known to transformers, with eager's explicit masks; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, eager_mask)
    return GROUPED
