"""Target adapter for Hugging Face causal LMs: prefill, one tree forward (4D ancestor mask + depth
positions) returning logits and final hidden states, and KV-cache compaction to the accepted path."""
from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tree_search.tree import Tree

# Probe verdicts that passed, per model, keyed on what the probe's outcome depends on: attention implementation,
# dtype and device (see `_probe_key`), so no change of any of them reuses a stale verdict.
_TREE_MASK_OK: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


class UnsupportedTargetError(TypeError):
    """The target model cannot verify a tree (no 4D attention masks, or a cache we cannot compact)."""


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


def window_capacity(model: torch.nn.Module) -> int | None:
    """Tokens a sliding-window cache holds before HF starts dropping its head (None = no sliding window).

    Once a window is full the cache keeps only its tail and a tree forward's 4D mask would no longer describe
    it, so generation (cache + one tree) must stay below this.
    """
    windows = [layer.sliding_window - 1 for layer in _cache_layers(model) if isinstance(layer, DynamicSlidingWindowLayer)]
    return min(windows) if windows else None


def _cache_layers(model: torch.nn.Module) -> list:
    """The cache layer objects HF builds for this model (cached per model: building them is not free)."""
    if model not in _LAYERS:
        _LAYERS[model] = list(DynamicCache(config=model.config).layers)
    return _LAYERS[model]


def _attn_implementation(model: torch.nn.Module) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def _probe_key(model: torch.nn.Module) -> tuple:
    param = next(model.parameters())
    return _attn_implementation(model), getattr(model, "dtype", param.dtype), param.device


def check_tree_support(model: torch.nn.Module) -> None:
    """Refuse targets whose attention cannot take an arbitrary 4D mask, naming the model class.

    Cheap static checks first (attention implementation, sliding-window layers, encoder-decoders), then a
    probe, once per (model, attention implementation, dtype, device): two sibling nodes must not see each other.
    A model that silently falls back to a causal mask fails the probe.
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedTargetError(f"{name} is an encoder-decoder; tree verification needs a decoder-only causal LM")
    attn = _attn_implementation(model)
    if "flash" in attn or attn == "flex_attention":
        raise UnsupportedTargetError(
            f"{name} uses attn_implementation={attn!r}, which ignores arbitrary 4D tree masks; "
            "load it with attn_implementation='sdpa' or 'eager'"
        )
    for layer in _cache_layers(model):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise UnsupportedTargetError(
                f"{name} uses {type(layer).__name__} cache layers; tree verification needs attention KV caches "
                "(DynamicLayer or DynamicSlidingWindowLayer) that can be compacted to the accepted path"
            )
    key = _probe_key(model)
    if key in _TREE_MASK_OK.get(model, ()):
        return
    try:
        ok = _probe_tree_mask(model)
    except Exception as err:  # the model's forward rejected a 4D mask, depth positions or our cache
        raise UnsupportedTargetError(f"{name} cannot run a tree-attention forward: {err}") from err
    if not ok:
        raise UnsupportedTargetError(
            f"{name} ignores 4D attention masks (attn_implementation={attn!r}), so it cannot verify a draft tree"
        )
    _TREE_MASK_OK.setdefault(model, set()).add(key)


@torch.no_grad()
def _probe_tree_mask(model: torch.nn.Module) -> bool:
    """Prefix a, root b, siblings c and d: d's logits must equal a plain forward of [a, b, d].

    Low-precision targets round the tree forward and the plain one differently, so the tolerance scales with the
    dtype's epsilon (bf16: 2^-7, a few rounding steps through the layers) and the logit magnitude; d's logits must
    also be closer to [a, b, d] than to the causal [a, b, c, d] a mask-ignoring model computes.
    """
    device = next(model.parameters()).device
    vocab = min(target_vocab_size(model), int(model.config.vocab_size))
    a, b, c, d = (torch.tensor(t % vocab, device=device) for t in (1, 2, 3, 4))
    state = TargetState(model)
    state.prefill(a.view(1, 1))
    logits, _ = state.tree_forward(torch.stack([b, c, d]), Tree((-1, 0, 0)))
    tree = logits[2].float()
    plain = model(input_ids=torch.stack([a, b, d]).view(1, 3), use_cache=False).logits[0, -1].float()
    causal = model(input_ids=torch.stack([a, b, c, d]).view(1, 4), use_cache=False).logits[0, -1].float()
    tol = max(1e-3, 4 * torch.finfo(_probe_key(model)[1]).eps) * (1 + plain.abs().max())
    error = (tree - plain).abs().max()
    return bool(error <= tol) and bool(error < (tree - causal).abs().max())


class TargetState:
    """The target model plus its KV cache of the committed sequence minus the last (root) token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None  # DynamicCache, created by prefill
        self.length = 0  # P: committed tokens held in the cache
        self.forwards = 0
        # The 4D mask each attention implementation takes (masking_utils): sdpa a boolean one (True = visible),
        # eager and the rest an additive float one in the model's dtype (0 visible, dtype-min hidden); eager adds
        # the mask to the scores, so a boolean one there would hide nothing.
        if _attn_implementation(model) == "sdpa":
            self._mask_dtype, self._visible, self._hidden = torch.bool, True, False
        else:
            self._mask_dtype = getattr(model, "dtype", next(model.parameters()).dtype)
            self._visible, self._hidden = 0.0, torch.finfo(self._mask_dtype).min
        self._trees: dict[Tree, tuple[torch.Tensor, torch.Tensor]] = {}  # per tree: (mask block, depths) on device

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Encode `input_ids` (1, L) into a fresh cache; returns the last position's logits (V,) (None if L = 0)."""
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        if input_ids.shape[1] == 0:
            return None
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.length = input_ids.shape[1]
        self.forwards += 1
        return out.logits[0, -1]

    @torch.no_grad()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Append one token (shape ()) and return the logits after it (V,). Autoregressive baseline step."""
        pos = torch.tensor([[self.length]], device=self.device)
        out = self.model(input_ids=token.view(1, 1), position_ids=pos, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.length += 1
        self.forwards += 1
        return out.logits[0, -1]

    def _tree_inputs(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's own (T+1, T+1) mask block and depths, moved to the device once per tree, not per round."""
        if tree not in self._trees:
            block = torch.full((len(tree), len(tree)), self._hidden, dtype=self._mask_dtype)
            block = block.masked_fill_(tree.ancestor_mask, self._visible).to(self.device)
            self._trees[tree] = block, torch.tensor(tree.depths, device=self.device)
        return self._trees[tree]

    @torch.no_grad()
    def tree_forward(
        self, tokens: torch.Tensor, tree: Tree, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over the root + all draft nodes (T+1 tokens) after the cached prefix.

        Node i sees the P cached positions plus itself and its ancestors, at position P + depth(i).
        Returns logits (T+1, V) and, if asked, the final hidden states (T+1, H). The cache then holds
        P + T + 1 entries until `commit` compacts it.
        """
        n = len(tree)
        block, depths = self._tree_inputs(tree)
        mask = torch.empty(1, 1, n, self.length + n, dtype=self._mask_dtype, device=self.device)
        mask[0, 0, :, : self.length] = self._visible
        mask[0, 0, :, self.length :] = block
        out = self.model(
            input_ids=tokens.view(1, n),
            attention_mask=mask,
            position_ids=(depths + self.length).view(1, n),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        self.cache = out.past_key_values
        self.forwards += 1
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0], hidden

    def commit(self, path: list[int], tree_size: int) -> None:
        """Keep the root and the accepted `path` nodes of the last tree forward, drop the other nodes.

        Accepted rows move down to the slots right after the root (dst < src, so in place is alias-safe),
        then the tail is cropped: the cache equals one built by encoding prefix + root + path.
        """
        root = self.length
        keep = len(path)
        if path:
            src = torch.tensor([root + i for i in path], device=self.device)
            dst = torch.arange(root + 1, root + 1 + keep, device=self.device)
            for layer in self.cache.layers:
                layer.keys[..., dst, :] = layer.keys[..., src, :]
                layer.values[..., dst, :] = layer.values[..., src, :]
        drop = tree_size - 1 - keep
        if drop:
            self.cache.crop(-drop)
        self.length = root + 1 + keep
