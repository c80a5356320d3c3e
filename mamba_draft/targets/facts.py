"""What the engine needs to know of a Hugging Face causal LM: limits, windows, cache layers and mask convention, read
from the model each time it is asked (cheap); what costs a forward to find out is kept by the engine that asked."""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from mamba_draft.targets.row_attention import ROW_STABLE
from mamba_draft.tree import Tree


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which this transformers' forward takes a KV cache: `cache` from 5.24 (`past_key_values`
    there warns and goes in 5.40), `past_key_values` before. The model fills the Cache object passed in place."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

def cache_layers(model: torch.nn.Module) -> list:
    """The cache layer objects transformers builds for the model (one per layer)."""
    return list(DynamicCache(config=model.config).layers)


def target_vocab_size(model: torch.nn.Module) -> int:
    """Width of the target's logits (its output embedding rows)."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def max_positions(model: torch.nn.Module) -> int | None:
    """The target's position-embedding limit (None if the config does not state one)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return int(limit) if limit is not None else None


def sliding_windows(model: torch.nn.Module) -> list[int]:
    """Tokens each sliding-window cache layer holds before HF starts dropping its head."""
    return [layer.sliding_window - 1 for layer in cache_layers(model)
            if isinstance(layer, DynamicSlidingWindowLayer)]


def window_capacity(model: torch.nn.Module) -> int | None:
    """Tokens a forward (cache + one tree) may span while tree verification stays exact (None = no window): past a
    sliding window HF keeps only the cache's tail, which a tree's 4D mask no longer describes; past a local window
    (`local_window`) the band hides keys."""
    windows = [*sliding_windows(model), local_window(model)]
    return min((w for w in windows if w is not None), default=None)


def local_window(model: torch.nn.Module) -> int | None:
    """The window of local attention layers that hide keys by their slot in the forward (None: no such layers):
    GPT-Neo's "local" layers see key slots (s - W, s] from query slot s, whatever the positions and the 4D mask say,
    so past W slots a tree's siblings lose keys their depth still sees; within W slots the tree mask is exact."""
    window = getattr(model.config, "window_size", None)
    local = "local" in (getattr(model.config, "attention_layers", None) or ())
    return window if local and isinstance(window, int) and window > 0 else None


def attn_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def probe_key(model: torch.nn.Module) -> tuple:
    """What the tree-mask probe's outcome depends on: attention implementation, dtype and device."""
    param = next(model.parameters())
    return attn_implementation(model), getattr(model, "dtype", param.dtype), param.device


def foreign_cache_layer(model: torch.nn.Module) -> str | None:
    """The name of a cache layer type the engine cannot compact (None: all are attention KV layers)."""
    return next((type(layer).__name__ for layer in cache_layers(model)
                 if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)), None)


def static_cache_refusal(model: torch.nn.Module, max_len: int) -> str | None:
    """Why a preallocated KV cache of `max_len` slots per layer cannot serve `model` (None: it can). Sliding-window
    and local attention layers are served exactly only while max_len stays within their window."""
    name = type(model).__name__
    foreign = foreign_cache_layer(model)
    if foreign is not None:
        return f"{name} has {foreign} cache layers; a static KV cache holds attention layers only"
    sliding = sliding_windows(model)
    if sliding and max_len > min(sliding):
        return (f"{name}'s sliding-window layers keep only the last {min(sliding)} tokens, fewer than the {max_len} "
                "slots asked of its static KV cache; use static=False")
    local = local_window(model)
    if local is not None and max_len > local:
        return (f"{name}'s local attention layers see only the last {local} slots of a forward "
                f"(window_size={local}), fewer than the {max_len} slots asked of its static KV cache; use static=False")
    return None


def last_logits_only(model: torch.nn.Module) -> dict:
    """`logits_to_keep=1` where the model's forward takes it: a prefill needs the last position's logits only, and
    the head over every prompt token costs time and B x L x V floats of memory."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


class UnsupportedTargetError(TypeError):
    """The target model cannot verify a tree (no 4D attention masks, or a cache we cannot compact)."""


class MaskStyle:
    """The 4D mask each attention implementation takes: sdpa, row attention and the compiled CPU step (`boolean`) a
    boolean one (True = visible), eager and the rest an additive float one in the model's dtype (0 visible, dtype-min
    hidden)."""

    def __init__(self, model: torch.nn.Module, boolean: bool = False) -> None:
        if boolean or attn_implementation(model) in ("sdpa", ROW_STABLE):
            self.dtype, self.visible, self.hidden = torch.bool, True, False
        else:
            self.dtype = getattr(model, "dtype", next(model.parameters()).dtype)
            self.visible, self.hidden = 0.0, torch.finfo(self.dtype).min

    def all_hidden(self, shape, device) -> torch.Tensor:
        return torch.full(shape, self.hidden, dtype=self.dtype, device=device)

    def block(self, tree: Tree, device) -> torch.Tensor:
        """The tree's own (T+1, T+1) block: node i sees node j iff j is i or an ancestor of i."""
        return self.all_hidden((len(tree), len(tree)), "cpu").masked_fill_(tree.ancestor_mask, self.visible).to(device)
