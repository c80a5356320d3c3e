"""Target adapter for Hugging Face causal LMs: prefill, one tree forward (4D ancestor mask + depth
positions) returning logits and final hidden states, and KV-cache compaction to the accepted path; for one prompt
(`TargetState`) or B left-padded prompts in one cache (`BatchTargetState`)."""
from __future__ import annotations

import inspect
import itertools
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from mamba_draft.row_blocks import low_precision_cpu, make_row_invariant, prefilling
from mamba_draft.targets import cache_keyword
from tree_search.graphs import capture_graph
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
    """Tokens a forward (cache + one tree) may span while tree verification stays exact (None = no window).

    Sliding-window caches: the tokens one holds before HF starts dropping its head; once a window is full the cache
    keeps only its tail and a tree forward's 4D mask would no longer describe it. Local attention windows
    (`local_window`): the window itself. Generation (cache + one tree) must stay within this.
    """
    windows = [layer.sliding_window - 1 for layer in _cache_layers(model) if isinstance(layer, DynamicSlidingWindowLayer)]
    local = local_window(model)
    if local is not None:
        windows.append(local)
    return min(windows) if windows else None


def local_window(model: torch.nn.Module) -> int | None:
    """The window of local attention layers that hide keys by their slot in the forward (None: no such layers).

    GPT-Neo's "local" layers (config.attention_layers, window_size W) mask each query's keys with a fixed band over
    slots (modeling_gpt_neo: bias = tril ^ tril(-W)): query slot s sees key slots (s - W, s], whatever the position
    ids and the 4D mask say. A tree's siblings sit at different slots but one depth, so once a forward spans more
    than W slots they lose keys their position still sees, and no mask can give them back (the band is applied
    before it). Within W slots the band hides nothing and local attention equals global attention: the tree mask is
    exact. Nothing drops keys from the cache itself (its layers stay DynamicLayer).
    """
    config = model.config
    window = getattr(config, "window_size", None)
    if "local" in (getattr(config, "attention_layers", None) or ()) and isinstance(window, int) and window > 0:
        return window
    return None


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
            "load it with attn_implementation='sdpa', 'eager' or 'row_stable'"
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
    """Prefix a, root b, siblings c and d: d's logits must equal those of the chain b, d (a plain sequence).

    Both run through TargetState (a prefill of a, then one forward), so they differ only by the mask and by the
    row count of their forward; targets without row blocks (fp32, GPU) may round those differently, so the
    tolerance scales with the dtype's epsilon (bf16: 2^-7, a few rounding steps through the layers) and the logit
    magnitude. d's logits must also be closer to the chain's than to the causal chain b, c, d that a
    mask-ignoring model computes.
    """
    device = next(model.parameters()).device
    vocab = min(target_vocab_size(model), int(model.config.vocab_size))
    a, b, c, d = (torch.tensor(t % vocab, device=device) for t in (1, 2, 3, 4))

    def last_logits(tokens, tree):
        state = TargetState(model)
        state.prefill(a.view(1, 1))
        return state.tree_forward(torch.stack(tokens), tree)[0][-1].float()

    tree = last_logits([b, c, d], Tree((-1, 0, 0)))
    plain = last_logits([b, d], Tree((-1, 0)))
    causal = last_logits([b, c, d], Tree((-1, 0, 1)))
    tol = max(1e-3, 4 * torch.finfo(_probe_key(model)[1]).eps) * (1 + plain.abs().max())
    error = (tree - plain).abs().max()
    return bool(error <= tol) and bool(error < (tree - causal).abs().max())


class _TreeMasks:
    """What single and batched target states share: the model, its 4D-mask convention and per-tree mask blocks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None  # DynamicCache, created by prefill
        self._cache_keyword = cache_keyword(model)
        self.forwards = 0
        # A low-precision CPU target's linear layers multiply in fixed blocks of rows (in place, once per model;
        # mamba_draft.row_blocks), so a position's logits do not depend on how many tokens share its forward.
        if low_precision_cpu(model):
            make_row_invariant(model)
        # The 4D mask each attention implementation takes (masking_utils): sdpa a boolean one (True = visible),
        # eager and the rest an additive float one in the model's dtype (0 visible, dtype-min hidden); eager adds
        # the mask to the scores, so a boolean one there would hide nothing.
        if _attn_implementation(model) == "sdpa":
            self._mask_dtype, self._visible, self._hidden = torch.bool, True, False
        else:
            self._mask_dtype = getattr(model, "dtype", next(model.parameters()).dtype)
            self._visible, self._hidden = 0.0, torch.finfo(self._mask_dtype).min
        self._trees: dict[Tree, tuple[torch.Tensor, torch.Tensor]] = {}  # per tree: (mask block, depths) on device

    def _cache_arg(self) -> dict:
        """Our cache under the keyword this transformers' forward takes (the model updates the object in place)."""
        return {self._cache_keyword: self.cache}

    def _tree_inputs(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's own (T+1, T+1) mask block and depths, moved to the device once per tree, not per round."""
        if tree not in self._trees:
            block = torch.full((len(tree), len(tree)), self._hidden, dtype=self._mask_dtype)
            block = block.masked_fill_(tree.ancestor_mask, self._visible).to(self.device)
            self._trees[tree] = block, torch.tensor(tree.depths, device=self.device)
        return self._trees[tree]


def static_cache_refusal(model: torch.nn.Module, max_len: int) -> str | None:
    """Why a preallocated KV cache of `max_len` slots per layer cannot serve `model` (None: it can).

    Sliding-window layers are served by plain full-length layers as long as the window never fills (nothing is
    dropped before then, so both hold the same keys); past that HF keeps a rolling buffer our slots cannot describe.
    Local attention layers (`local_window`) see a static cache's forward as its last slots (they take the band's
    rows from the key count, max_len), so the band hides nothing only while max_len stays within the window.
    """
    name = type(model).__name__
    for layer in _cache_layers(model):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            return f"{name} has {type(layer).__name__} cache layers; a static KV cache holds attention layers only"
    sliding = [layer.sliding_window - 1 for layer in _cache_layers(model)
               if isinstance(layer, DynamicSlidingWindowLayer)]
    if sliding and max_len > min(sliding):
        return (f"{name}'s sliding-window layers keep only the last {min(sliding)} tokens, fewer than the {max_len} "
                "slots asked of its static KV cache; use static=False")
    local = local_window(model)
    if local is not None and max_len > local:
        return (f"{name}'s local attention layers see only the last {local} slots of a forward "
                f"(window_size={local}), fewer than the {max_len} slots asked of its static KV cache; use static=False")
    return None


def _use_static(model: torch.nn.Module, device: torch.device, static: bool | None, max_len: int | None) -> bool:
    """Resolve TargetState's `static` argument; refuse a bad `max_len` or a static cache the model cannot use."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int (KV slots to preallocate), got {max_len!r}")
    if static is None:  # auto: static on CUDA (capturable); on CPU, where nothing is captured, the dynamic cache
        # is as fast or faster (measured: static attends over all max_len slots, dynamic over P + n)
        return device.type == "cuda" and max_len is not None and static_cache_refusal(model, max_len) is None
    if static:
        if max_len is None:
            raise ValueError("static=True needs max_len: prompt + max_new_tokens + the widest tree's node count + 1")
        reason = static_cache_refusal(model, max_len)
        if reason is not None:
            raise UnsupportedTargetError(reason)
    return bool(static)


def _weights_key(model: torch.nn.Module) -> tuple:
    """What a static state's cache, buffers and graphs depend on: attention, dtype, device and weight addresses."""
    addresses = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
    return _probe_key(model), addresses


class _SlotLayer(StaticLayer):
    """A preallocated KV layer (HF's StaticLayer storage, (1, heads, max_len, head_dim)) written at the slots its
    TargetState chose. HF's StaticLayer appends at a per-layer running count; here all layers read one shared index
    buffer the state fills once per forward, so a commit needs no per-layer bookkeeping and a captured graph reads
    the slots from a fixed address. Its `cumulative_length` stays 0: HF reads it only to build the causal mask of a
    forward given no mask, which here is only the prefill, written from slot 0."""

    def __init__(self, max_cache_len: int, slots: torch.Tensor) -> None:
        super().__init__(max_cache_len)
        self.slots = slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.slots[: key_states.shape[-2]]
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values


class _TreeSize:
    """The static path's fixed-shape buffers for trees of n tokens (root included): every input of their forward
    and commit, so one captured graph per n reads them all from fixed addresses."""

    def __init__(self, n: int, max_len: int, mask_dtype: torch.dtype, hidden, device: torch.device) -> None:
        self.ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.long, device=device)
        self.mask = torch.full((1, 1, n, max_len), hidden, dtype=mask_dtype, device=device)
        self.visible = 0  # mask columns [0, visible) are already visible (the committed prefix)
        self.src = torch.zeros(n - 1, dtype=torch.long, device=device)  # commit: slot P+1+j takes slot src[j]
        self.dst = torch.zeros(n - 1, dtype=torch.long, device=device)  # commit: P+1 ... P+n-1
        self.scratch: dict[tuple, torch.Tensor] = {}  # commit: rows gathered per cache-layer shape
        self.outputs: dict[bool, tuple] = {}  # graphs: (logits, hidden) copied out, per want_hidden
        self.graphs: dict[object, torch.cuda.CUDAGraph] = {}  # want_hidden -> forward graph, "commit" -> commit graph


_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, TargetState]" = weakref.WeakKeyDictionary()


class TargetState(_TreeMasks):
    """The target model plus its KV cache of the committed sequence minus the last (root) token.

    Two caches, same greedy output (the target's own `generate`, token for token):

    - dynamic (HF DynamicCache, `static=False`): each forward concatenates its keys, commit compacts the accepted
      rows and crops the tail. Shapes change every round, so nothing can be captured.
    - static (`static=True`, `max_len` slots preallocated per layer): a tree of n tokens is written at slots
      [P, P+n) and attends through a (1, 1, n, max_len) mask (the P committed slots + its ancestor block; every
      later slot, stale or empty, hidden); commit moves the accepted rows down in place (gather, then scatter) and
      crops nothing. All inputs live in per-tree-size buffers (`_TreeSize`): one fixed shape per tree size, no
      allocation per round, no host sync besides the accepted path the caller hands to `commit`. `graphs=True`
      (CUDA) captures one CUDA graph per (tree size, want_hidden) for the forward and one per tree size for the
      commit, and replays them; their logits / hidden outputs are copied into per-size buffers, valid until the
      next forward of the same tree size. Alternatively `state.forward = torch.compile(model.forward,
      mode="reduce-overhead")` (graphs=False) compiles one graph per tree size (outputs valid until the next call).

    `static=None` (auto) is static on CUDA when `max_len` is given and the model allows it (`static_cache_refusal`),
    else dynamic: on CPU the dynamic cache is as fast or faster (it attends over P + n keys, not max_len).
    `max_len` must cover every forward: prompt + max_new_tokens + the widest tree (root included); a forward beyond
    it is refused before it runs.
    """

    def __init__(self, model: torch.nn.Module, static: bool | None = None, max_len: int | None = None,
                 graphs: bool = False) -> None:
        super().__init__(model)
        self.length = 0  # P: committed tokens held in the cache
        self.static = _use_static(model, self.device, static, max_len)
        if graphs and not (self.static and self.device.type == "cuda"):
            raise ValueError("graphs=True needs the static KV cache (static=True, max_len) on a CUDA device")
        self.use_graphs = graphs
        self.max_len = max_len if self.static else None
        self.forward = model  # the static tree forward's model call (replaceable by a torch.compile'd forward)
        if self.static:
            self._arange = torch.arange(max_len, device=self.device)
            self._slots = torch.zeros(max_len, dtype=torch.long, device=self.device)  # where the next forward writes
            self.cache = Cache(layers=[_SlotLayer(max_len, self._slots) for _ in _cache_layers(model)])
            self._sizes: dict[int, _TreeSize] = {}
            # commit's sources, written on the host without allocating, then one copy to the device
            self._src_host = torch.zeros(max_len, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._src_numpy = self._src_host.numpy()
            self._copied = None  # CUDA event: the last copy out of _src_host is done
            self._pool = None  # one memory pool for all graphs
            self.key = _weights_key(model)

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_len: int, static: bool | None = None,
                  graphs: bool = False) -> TargetState:
        """A TargetState for one generate call. A static one (cache, buffers, graphs) is cached per model and reused
        while it has room (its max_len >= max_len) and the model's attention, dtype, device and weight addresses
        are unchanged; a dynamic one is fresh (it holds nothing worth keeping). `graphs` applies only when the
        state is static, so `graphs=True` with static=None is safe on any device and model."""
        if not _use_static(model, next(model.parameters()).device, static, max_len):
            return cls(model, static=False)
        cached = _STATES.get(model)
        if (cached is None or cached.max_len < max_len or cached.use_graphs != graphs
                or cached.key != _weights_key(model)):
            cached = _STATES[model] = cls(model, static=True, max_len=max_len, graphs=graphs)
        return cached

    def _check_room(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"the static KV cache holds {self.max_len} tokens but this forward needs {needed}: "
                             "pass max_len >= prompt + max_new_tokens + the widest tree's node count + 1")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Encode `input_ids` (1, L) into a fresh cache; returns the last position's logits (V,) (None if L = 0)."""
        self.length = 0
        length = input_ids.shape[1]
        if self.static:
            self._check_room(length)
            for size in self._sizes.values():  # a new sequence: no slot is committed yet
                size.mask.fill_(self._hidden)
                size.visible = 0
        else:
            self.cache = DynamicCache(config=self.model.config)
        if length == 0:
            return None
        with prefilling(self.model):
            if self.static:
                self._slots[:length].copy_(self._arange[:length])
                out = self.model(input_ids=input_ids, position_ids=self._arange[:length].view(1, length),
                                 **self._cache_arg(), use_cache=True, **last_logits_only(self.model))
            else:
                out = self.model(input_ids=input_ids, **self._cache_arg(), use_cache=True,
                                 **last_logits_only(self.model))
        self.length = length
        self.forwards += 1
        return out.logits[0, -1]

    @torch.no_grad()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Append one token (shape ()) and return the logits after it (V,). Autoregressive baseline step."""
        if self.static:  # a root-only tree: its graph is the baseline's captured step
            logits, _ = self.tree_forward(token.view(1), _ROOT_ONLY)
            self.commit([], 1)
            return logits[0]
        pos = torch.tensor([[self.length]], device=self.device)
        out = self.model(input_ids=token.view(1, 1), position_ids=pos, **self._cache_arg(), use_cache=True)
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
        if self.static:
            return self._static_tree_forward(tokens, tree, want_hidden)
        block, depths = self._tree_inputs(tree)
        n = len(tree)
        mask = torch.empty(1, 1, n, self.length + n, dtype=self._mask_dtype, device=self.device)
        mask[0, 0, :, : self.length] = self._visible
        mask[0, 0, :, self.length :] = block
        out = self.model(
            input_ids=tokens.view(1, n),
            attention_mask=mask,
            position_ids=(depths + self.length).view(1, n),
            **self._cache_arg(),
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        self.forwards += 1
        return out.logits[0], out.hidden_states[-1][0] if want_hidden else None

    @torch.no_grad()
    def commit(self, path: list[int], tree_size: int) -> None:
        """Keep the root and the accepted `path` nodes of the last tree forward, drop the other nodes.

        Accepted rows move down to the slots right after the root (dst < src, so in place is alias-safe),
        then the tail is cropped (dynamic) or left behind the mask (static): the cache's committed slots equal
        one built by encoding prefix + root + path.
        """
        if self.static:
            return self._static_commit(path, tree_size)
        root = self.length
        keep = len(path)
        if path != list(range(1, keep + 1)):  # nodes 1..keep already sit right after the root (every chain round)
            src = torch.tensor([root + i for i in path], device=self.device)
            dst = torch.arange(root + 1, root + 1 + keep, device=self.device)
            for layer in self.cache.layers:
                layer.keys[..., dst, :] = layer.keys[..., src, :]
                layer.values[..., dst, :] = layer.values[..., src, :]
        drop = tree_size - 1 - keep
        if drop:
            self.cache.crop(-drop)
        self.length = root + 1 + keep

    def _size(self, n: int) -> _TreeSize:
        if n not in self._sizes:
            self._sizes[n] = _TreeSize(n, self.max_len, self._mask_dtype, self._hidden, self.device)
        return self._sizes[n]

    def _static_tree_forward(self, tokens: torch.Tensor, tree: Tree, want_hidden: bool):
        """Fill tree size n's buffers (ids, positions P + depth, write slots [P, P+n), mask), then run its forward
        (eager, or its graph). Only the mask columns that changed since this size's last forward are written."""
        n, start = len(tree), self.length
        self._check_room(start + n)
        size = self._size(n)
        block, depths = self._tree_inputs(tree)
        size.ids.view(-1).copy_(tokens.view(-1))
        torch.add(depths, start, out=size.positions[0])
        torch.add(self._arange[:n], start, out=self._slots[:n])
        mask = size.mask[0, 0]
        if size.visible < start:
            mask[:, size.visible : start] = self._visible
            size.visible = start
        mask[:, start : start + n] = block  # earlier blocks of this size end before P + n: P only grows
        self.forwards += 1
        if not self.use_graphs:
            return self._forward(size, want_hidden)
        if want_hidden not in size.graphs:
            size.graphs[want_hidden] = self._capture(lambda: self._forward_into(size, want_hidden))
        size.graphs[want_hidden].replay()
        return size.outputs[want_hidden]

    def _forward(self, size: _TreeSize, want_hidden: bool):
        out = self.forward(input_ids=size.ids, attention_mask=size.mask, position_ids=size.positions,
                           **self._cache_arg(), use_cache=True, output_hidden_states=want_hidden)
        return out.logits[0], out.hidden_states[-1][0] if want_hidden else None

    def _forward_into(self, size: _TreeSize, want_hidden: bool) -> None:
        """The captured forward: outputs copied into buffers of their own (allocated at the first, eager warm-up),
        so another graph's replay in the shared pool cannot overwrite them."""
        logits, hidden = self._forward(size, want_hidden)
        if want_hidden not in size.outputs:
            size.outputs[want_hidden] = torch.empty_like(logits), None if hidden is None else torch.empty_like(hidden)
        logits_out, hidden_out = size.outputs[want_hidden]
        logits_out.copy_(logits)
        if hidden_out is not None:
            hidden_out.copy_(hidden)

    def _static_commit(self, path: list[int], tree_size: int) -> None:
        """Slots P+1 ... P+n-1 take slots src: the path's rows first, then each unaccepted slot itself (fixed shape
        per tree size; the self-copies land beyond the committed prefix, where the mask hides them)."""
        root, keep = self.length, len(path)
        if keep:
            size = self._sizes[tree_size]
            if self._copied is not None:
                self._copied.synchronize()  # the previous round's copy has read _src_host (long done by now)
            self._src_numpy[: tree_size - 1] = [root + i for i in path] + list(range(root + 1 + keep, root + tree_size))
            size.src.copy_(self._src_host[: tree_size - 1], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
            torch.add(self._arange[1:tree_size], root, out=size.dst)
            if not self.use_graphs:
                self._move(size)
            else:
                if "commit" not in size.graphs:
                    sources = size.src.clone()
                    size.src.copy_(size.dst)  # the warm-up runs must not move anything: identity moves
                    size.graphs["commit"] = self._capture(lambda: self._move(size))
                    size.src.copy_(sources)
                size.graphs["commit"].replay()
        self.length = root + 1 + keep

    def _move(self, size: _TreeSize) -> None:
        """In every layer, slots dst <- slots src: gather all sources into scratch first, then scatter (alias-safe)."""
        for layer in self.cache.layers:
            for kv in (layer.keys, layer.values):
                key = (kv.shape[1], kv.shape[3], kv.dtype)
                if key not in size.scratch:
                    size.scratch[key] = kv.new_empty(kv.shape[0], kv.shape[1], size.src.numel(), kv.shape[3])
                torch.index_select(kv, 2, size.src, out=size.scratch[key])
                kv.index_copy_(2, size.dst, size.scratch[key])

    def _capture(self, body) -> torch.cuda.CUDAGraph:
        """Capture `body` into the shared pool after two warm-up runs on a side stream (cuBLAS workspaces, buffer
        allocation); the caller makes those runs harmless (a forward rewrites the slots the replay writes)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(body, self._pool, self.device)


class OneRow:
    """One prompt's `TargetState` (static cache and captured verification on CUDA, no validity mask) in the batched
    shapes of `BatchTargetState`, so one generation loop serves both: tokens (1, n), logits (1, n, V), one path per
    row. A batch of one is still a batch: its row finishing ends the call, so it never drops rows."""

    def __init__(self, state: TargetState) -> None:
        self.state = state
        self._size = 0  # nodes of the last tree forward (its commit needs them)

    @property
    def forwards(self) -> int:
        return self.state.forwards

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        logits = self.state.prefill(input_ids)
        return None if logits is None else logits[None]

    def tree_forward(self, tokens: torch.Tensor, tree: Tree, want_hidden: bool = False):
        self._size = len(tree)
        logits, hidden = self.state.tree_forward(tokens[0], tree, want_hidden)
        return logits[None], None if hidden is None else hidden[None]

    def commit(self, paths: list[list[int]]) -> None:
        self.state.commit(paths[0], self._size)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.state.decode(tokens[0])[None]


def _padding_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Check left-padded (B, L) ids + mask (no model needed) -> the mask as bool (B, L) on the ids' device."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"batched input_ids must be a (B, L) tensor, got {shape}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise ValueError("the batch is empty: input_ids has no rows")
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a (B, L) tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} "
                         f"but input_ids has shape {tuple(input_ids.shape)}")
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)
    late = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1).nonzero()  # a pad after a token: right (or inner) padding
    if late.numel():
        raise ValueError(f"prompt {int(late[0])} is not left-padded (a pad follows a token): pad prompts on the left")
    return mask


def check_batch_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Refuse what a batch prefill cannot take (no model needed): ids not (B, L), a mask of another shape, values
    other than 0/1, right padding, empty prompts. Returns each prompt's length (its tokens, pads excluded)."""
    lengths = _padding_mask(input_ids, attention_mask).sum(dim=1).tolist()
    if 0 in lengths:
        raise ValueError(f"prompt {lengths.index(0)} is empty (its attention_mask row is all zeros)")
    return lengths


class BatchTargetState(_TreeMasks):
    """The target plus one KV cache for B prompts, each row holding its committed sequence minus its root token.

    All rows share the cache's slots; `valid` (B, slots) says which slot holds a token of a row: left pads and the
    holes a shorter accepted path leaves stay invalid (masked for every later query). RoPE positions are per row
    (`positions`, pads and holes do not count), so each row's keys equal those of encoding that row alone.
    Separate from `TargetState` because that one's contract (cache length = committed length, no validity mask,
    unbatched shapes) is what single-prompt generation and the tree-mask probe rely on.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.slots = 0  # S: cache length, common to all rows (host int, so no sync is needed to size masks)
        self.positions = None  # (B,) long on device: each row's committed tokens in the cache (its root's position)
        self._slots = None  # (B, capacity) in mask form (visible / hidden); [:, :S] is the valid slots
        self._pending = None  # the tree of the last tree forward, awaiting its commit
        windows = [layer.sliding_window - 1 for layer in _cache_layers(model)
                   if isinstance(layer, DynamicSlidingWindowLayer)]
        self._window = min(windows) if windows else None

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        """(B, slots) bool: slot j holds a committed token of row b."""
        return self._slots[:, : self.slots] == self._visible

    def _reserve(self, slots: int) -> None:
        """Room for `slots` columns in the validity buffer; grows geometrically, so rounds rarely allocate."""
        if slots > self._slots.shape[1]:
            grown = torch.full((self._slots.shape[0], max(slots, 2 * self._slots.shape[1])), self._hidden,
                               dtype=self._mask_dtype, device=self.device)
            grown[:, : self.slots] = self._slots[:, : self.slots]
            self._slots = grown
        if self._window is not None and slots > self._window:
            raise ValueError(f"the batch cache needs {slots} slots, beyond the {self._window} that "
                             f"{type(self.model).__name__}'s sliding-window cache holds exactly")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Encode left-padded prefixes (B, L) into a fresh cache -> the last column's logits (B, V) (None if L = 0).

        A row may be all pads (the prefix of a one-token prompt): its cache starts empty and its logits here are
        meaningless. Every query also sees itself, so pad rows attend to something and stay finite.
        """
        valid = _padding_mask(input_ids, attention_mask).to(self.device)
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        self.cache = DynamicCache(config=self.model.config)
        self.positions = valid.sum(dim=1)
        self.slots, self._pending = 0, None
        self._slots = torch.full((batch, max(length, 1)), self._hidden, dtype=self._mask_dtype, device=self.device)
        if length == 0:
            return None
        self._reserve(length)
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril_()
        eye = torch.eye(length, dtype=torch.bool, device=self.device)
        seen = (causal & valid[:, None, :]) | eye  # (B, L, L)
        mask = torch.full(seen.shape, self._hidden, dtype=self._mask_dtype, device=self.device)
        mask = mask.masked_fill_(seen, self._visible)[:, None]
        with prefilling(self.model):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=(valid.cumsum(dim=1) - 1).clamp_(min=0),  # pads do not count; theirs is never seen
                **self._cache_arg(),
                use_cache=True,
                **last_logits_only(self.model),
            )
        self._slots[:, :length].masked_fill_(valid, self._visible)
        self.slots = length
        self.forwards += 1
        return out.logits[:, -1]

    @torch.no_grad()
    def tree_forward(
        self, tokens: torch.Tensor, tree: Tree, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward of every row's tree: tokens (B, T+1), node order as in `tree`, tokens[:, 0] the roots.

        Row b's node i sees row b's valid slots plus its own ancestors, at position positions[b] + depth(i).
        Returns logits (B, T+1, V) and, if asked, final hidden states (B, T+1, H); then `commit`.
        """
        n, batch = len(tree), self.batch_size
        if tokens.shape != (batch, n):
            raise ValueError(f"tree_forward needs tokens of shape ({batch}, {n}), got {tuple(tokens.shape)}")
        block, depths = self._tree_inputs(tree)
        self._reserve(self.slots + n)
        mask = torch.empty(batch, 1, n, self.slots + n, dtype=self._mask_dtype, device=self.device)
        mask[:, 0, :, : self.slots] = self._slots[:, None, : self.slots]
        mask[:, 0, :, self.slots :] = block
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=self.positions[:, None] + depths,
            **self._cache_arg(),
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        self._pending = tree
        self.forwards += 1
        return out.logits, out.hidden_states[-1] if want_hidden else None

    def commit(self, paths: list[list[int]]) -> None:
        """Keep each row's root + accepted `paths[b]` (node indices in depth order) of the last tree forward.

        Row b's path nodes move to the slots right after its root; slots past them up to the longest path are
        holes (invalid for that row), and the tail no row uses is cropped. Each row's valid slots then equal
        encoding its committed sequence alone; its position advances by 1 + len(path).
        """
        tree, root = self._pending, self.slots
        if tree is None:
            raise ValueError("commit needs a tree_forward first")
        if len(paths) != self.batch_size:
            raise ValueError(f"commit needs one path per row ({self.batch_size}), got {len(paths)}")
        for b, path in enumerate(paths):
            if any(not 0 < node < len(tree) or tree.parents[node] != parent
                   for parent, node in zip([0, *path], path)):
                raise ValueError(f"path {list(path)} of row {b} is not a root-to-node path of the tree")
        self._pending = None
        longest = max(map(len, paths))
        self._slots[:, root] = self._visible
        if longest:
            # One host -> device copy per round: each row's source slots (hole slots copy themselves), then its
            # path length. Every source is at or after its destination and the gather reads before the write, so
            # the in-place move is alias-safe.
            index = torch.tensor([[root + i for i in path] + list(range(root + 1 + len(path), root + 1 + longest))
                                  + [len(path)] for path in paths], device=self.device)
            src, kept = index[:, None, :-1, None], index[:, -1]
            for layer in self.cache.layers:
                layer.keys[:, :, root + 1 : root + 1 + longest] = torch.take_along_dim(layer.keys, src, dim=2)
                layer.values[:, :, root + 1 : root + 1 + longest] = torch.take_along_dim(layer.values, src, dim=2)
            holes = torch.arange(longest, device=self.device) >= kept[:, None]
            self._slots[:, root + 1 : root + 1 + longest] = self._visible
            self._slots[:, root + 1 : root + 1 + longest].masked_fill_(holes, self._hidden)
            self.positions += 1 + kept
        else:  # a root-only round (decode): nothing to move, nothing to copy over
            self.positions += 1
        drop = len(tree) - 1 - longest
        if drop:
            self.cache.crop(-drop)
        self.slots = root + 1 + longest

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (B,) and return the logits after it (B, V): the batched autoregressive step,
        a root-only tree forward and its commit."""
        logits, _ = self.tree_forward(tokens.view(-1, 1), _ROOT_ONLY)
        self.commit([[]] * self.batch_size)
        return logits[:, 0]

    def drop_rows(self, keep) -> None:
        """Keep only rows `keep` (increasing row indices) in the cache and every per-row buffer, so finished rows
        cost no more target work. Slots no remaining row uses (pads of a dropped longer prompt, holes) go too:
        the cache is copied here anyway."""
        keep = torch.as_tensor(keep, dtype=torch.long).flatten()
        if keep.numel() == 0:
            raise ValueError("drop_rows needs at least one row to keep")
        if (keep < 0).any() or (keep >= self.batch_size).any() or (keep[1:] <= keep[:-1]).any():
            raise ValueError(f"drop_rows needs increasing row indices in [0, {self.batch_size}), got {keep.tolist()}")
        if self._pending is not None:
            raise ValueError("drop_rows after a tree_forward needs its commit first")
        keep = keep.to(self.device)
        self._slots, self.positions = self._slots[keep], self.positions[keep]
        used = self.valid.any(dim=0)
        cols = None if bool(used.all()) else used.nonzero().flatten()
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            if cols is not None:
                layer.keys, layer.values = layer.keys[:, :, cols], layer.values[:, :, cols]
                if isinstance(layer, DynamicSlidingWindowLayer):
                    layer.cumulative_length = layer.keys.shape[-2]
        if cols is not None:
            self.slots = cols.numel()
            self._slots[:, : self.slots] = self._slots[:, cols]


_ROOT_ONLY = Tree((-1,))
_TAKES_LOGITS_TO_KEEP: dict[type, bool] = {}


def last_logits_only(model: torch.nn.Module) -> dict:
    """`logits_to_keep=1` where the model's forward takes it (transformers' causal LMs, as their own `generate`
    prefills): a prefill needs the last position's logits only, and the head over every prompt token is a fifth of a
    135M model's prefill (49k x 576 head) and B x L x V floats of memory."""
    kind = type(model)
    if kind not in _TAKES_LOGITS_TO_KEEP:
        try:
            _TAKES_LOGITS_TO_KEEP[kind] = "logits_to_keep" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # a forward without an inspectable signature: keep every position
            _TAKES_LOGITS_TO_KEEP[kind] = False
    return {"logits_to_keep": 1} if _TAKES_LOGITS_TO_KEEP[kind] else {}
