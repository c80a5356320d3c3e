"""Whether a target can verify a draft tree.

A tree forward hands the model a 4D mask in which a node sees the committed slots and its own ancestors only, and
depth positions; a model that ignores the mask (flash attention, a silent causal fallback) would verify the wrong
sequences. `check_tree_support` refuses those by static checks, then by a probe run once per (model, attention,
dtype, device) and remembered by the engine that asked (`SpeculativeDecoder`).
"""
from __future__ import annotations

import torch

from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets import cpu_step
from mamba_draft.targets.exact import is_prepared, require_prepared
from mamba_draft.targets.row_blocks import low_precision_cpu
from mamba_draft.targets.facts import (
    UnsupportedTargetError, attn_implementation, foreign_cache_layer, probe_key, target_vocab_size,
)
from mamba_draft.tree import Tree


def check_tree_support(model: torch.nn.Module, passed: set | None = None) -> None:
    """Refuse targets whose attention cannot take an arbitrary 4D mask, naming the model class (module docstring).
    `passed`: the probe keys (`probe_key`) whose probe this model passed, kept by the caller (the engine) and
    added to here; None: probe every time."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedTargetError(f"{name} is an encoder-decoder; tree verification needs a decoder-only causal LM")
    attn = attn_implementation(model)
    if "flash" in attn or attn == "flex_attention":
        raise UnsupportedTargetError(f"{name} uses attn_implementation={attn!r}, which ignores arbitrary 4D tree "
                                     "masks; load it with attn_implementation='sdpa', 'eager' or 'row_stable'")
    foreign = foreign_cache_layer(model)
    if foreign is not None:
        raise UnsupportedTargetError(f"{name} uses {foreign} cache layers; tree verification needs attention KV caches "
                                     "(DynamicLayer or DynamicSlidingWindowLayer) that can be compacted to the "
                                     "accepted path")
    if cpu_step.applies(model) and low_precision_cpu(model) and not is_prepared(model):
        return  # the compiled step verifies its trees with attention of its own; transformers' forward never does
    require_prepared(model)  # the attention that will verify is the one probed
    key, passed = probe_key(model), set() if passed is None else passed
    if key in passed:
        return
    try:
        ok = _probe_tree_mask(model)
    except Exception as err:  # the model's forward rejected a 4D mask, depth positions or our cache
        raise UnsupportedTargetError(f"{name} cannot run a tree-attention forward: {err}") from err
    if not ok:
        raise UnsupportedTargetError(f"{name} ignores 4D attention masks (attn_implementation={attn!r}), so it cannot "
                                     "verify a draft tree")
    passed.add(key)


@torch.no_grad()
def _probe_tree_mask(model: torch.nn.Module) -> bool:
    """Prefix a, root b, siblings c and d: d's logits must equal those of the chain b, d, and be closer to them than
    to the causal chain b, c, d's (what a mask-ignoring model computes). The forwards differ in row count, which
    targets without row blocks may round differently: the tolerance scales with the dtype's epsilon."""
    device = next(model.parameters()).device
    vocab = min(target_vocab_size(model), int(model.config.vocab_size))
    a, b, c, d = (t % vocab for t in (1, 2, 3, 4))

    def last_logits(tokens, tree):
        state = TargetCache(model)
        state.prefill(torch.tensor([[a]], device=device))
        return state.tree_forward(torch.tensor([tokens], device=device), tree)[0][0, -1].float()

    tree = last_logits([b, c, d], Tree((-1, 0, 0)))
    plain = last_logits([b, d], Tree((-1, 0)))
    causal = last_logits([b, c, d], Tree((-1, 0, 1)))
    tol = max(1e-3, 4 * torch.finfo(probe_key(model)[1]).eps) * (1 + plain.abs().max())
    error = (tree - plain).abs().max()
    return bool(error <= tol) and bool(error < (tree - causal).abs().max())
