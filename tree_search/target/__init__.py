"""The target side of tree verification, for any Hugging Face causal LM.

- `facts`: what the engine reads of a model once (logits width, limits, windows, cache layers, mask convention),
  kept on the model;
- `tree_mask`: whether its attention takes a tree's 4D mask (static checks + a probe);
- `cache`: `TargetCache`, one KV cache for B prompts: prefill, tree forward, commit, decode, drop rows.
"""
from tree_search.target.cache import TargetCache, use_static
from tree_search.target.facts import (
    TargetFacts, UnsupportedTargetError, local_window, max_positions, static_cache_refusal, target_vocab_size,
    window_capacity,
)
from tree_search.target.tree_mask import check_tree_support

__all__ = [
    "TargetCache", "TargetFacts", "UnsupportedTargetError", "check_tree_support", "local_window", "max_positions",
    "static_cache_refusal", "target_vocab_size", "use_static", "window_capacity",
]
