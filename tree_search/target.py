"""Target adapter for Hugging Face causal LMs: prefill, one tree forward (4D ancestor mask + depth
positions) returning logits and final hidden states, and KV-cache compaction to the accepted path."""
from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tree_search.tree import Tree

_TREE_MASK_OK: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
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


def check_tree_support(model: torch.nn.Module) -> None:
    """Refuse targets whose attention cannot take an arbitrary 4D mask, naming the model class.

    Cheap static checks first (attention implementation, sliding-window layers, encoder-decoders), then a
    once-per-model probe: two sibling nodes must not see each other. A model that silently falls back to a
    causal mask fails the probe.
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedTargetError(f"{name} is an encoder-decoder; tree verification needs a decoder-only causal LM")
    attn = getattr(config, "_attn_implementation", None) or "eager"
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
    if model in _TREE_MASK_OK:
        return
    try:
        ok = _probe_tree_mask(model)
    except Exception as err:  # the model's forward rejected a 4D mask, depth positions or our cache
        raise UnsupportedTargetError(f"{name} cannot run a tree-attention forward: {err}") from err
    if not ok:
        raise UnsupportedTargetError(f"{name} ignores 4D attention masks, so it cannot verify a draft tree")
    _TREE_MASK_OK[model] = True


@torch.no_grad()
def _probe_tree_mask(model: torch.nn.Module) -> bool:
    """Prefix a, root b, siblings c and d: d's logits must equal a plain forward of [a, b, d]."""
    device = next(model.parameters()).device
    vocab = min(target_vocab_size(model), int(model.config.vocab_size))
    a, b, c, d = (torch.tensor(t % vocab, device=device) for t in (1, 2, 3, 4))
    state = TargetState(model)
    state.prefill(a.view(1, 1))
    logits, _ = state.tree_forward(torch.stack([b, c, d]), Tree((-1, 0, 0)))
    plain = model(input_ids=torch.stack([a, b, d]).view(1, 3), use_cache=False).logits[0, -1]
    return bool(torch.allclose(logits[2].float(), plain.float(), atol=1e-3, rtol=1e-3))


class TargetState:
    """The target model plus its KV cache of the committed sequence minus the last (root) token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None  # DynamicCache, created by prefill
        self.length = 0  # P: committed tokens held in the cache
        self.ids = torch.zeros(1, 0, dtype=torch.long, device=self.device)  # the tokens the cache holds (1, P)
        self.forwards = 0
        self._pending: torch.Tensor | None = None  # tree tokens of the last tree_forward

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Encode `input_ids` (1, L) into a fresh cache; returns the last position's logits (V,) (None if L = 0)."""
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        self.ids = input_ids
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
        self.ids = torch.cat([self.ids, token.view(1, 1)], dim=1)
        self.length += 1
        self.forwards += 1
        return out.logits[0, -1]

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
        mask = torch.ones(1, 1, n, self.length + n, dtype=torch.bool, device=self.device)
        mask[0, 0, :, self.length :] = tree.ancestor_mask.to(self.device)
        positions = (torch.tensor(tree.depths, device=self.device) + self.length).view(1, n)
        out = self.model(
            input_ids=tokens.view(1, n),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        self.cache = out.past_key_values
        self._pending = tokens
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
        self.ids = torch.cat([self.ids, self._pending[[0] + list(path)].view(1, -1)], dim=1)
        self.length = root + 1 + keep

