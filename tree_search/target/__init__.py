"""The target side of tree verification, for any Hugging Face causal LM: what the engine reads of a model
(`facts`), whether its attention takes a tree's 4D mask (`tree_mask`), and one KV cache for B prompts (`cache`)."""
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
