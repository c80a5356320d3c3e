"""The target's side of a round: one KV cache for B left-padded prompts, a tree forward over every row's draft tree
(4D ancestor mask, depth positions) and the commit of each row's accepted path.

All rows share the cache's slots; `valid` (B, slots) says which slot holds a token of a row: left pads and the holes
a shorter accepted path leaves stay invalid. RoPE positions are per row (pads and holes do not count), so each row's
keys equal those of encoding that row alone. Two storages hold the same tokens: dynamic (HF DynamicCache, the
default on CPU: it attends over the slots in use only) and static (`max_len` slots per layer preallocated, the
default on CUDA: every input lives in per-(B, n) buffers, so `graphs=True` captures one graph per forward shape and
per commit shape, and a round's only host -> device copy is the accepted paths).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, StaticLayer

from mamba_draft.graphs import capture_graph, to_device, weights_key
from mamba_draft.targets import cpu_step
from mamba_draft.targets.exact import is_prepared, prefilling, require_prepared
from mamba_draft.targets.facts import (
    MaskStyle, UnsupportedTargetError, cache_keyword, cache_layers, last_logits_only, probe_key, sliding_windows,
    static_cache_refusal,
)
from mamba_draft.tree import Tree

ROOT_ONLY = Tree((-1,))
STEP_PREFILL = 512  # the longest prompt the compiled step prefills with integer products (`_step_prefill`)


class _SlotLayer(StaticLayer):
    """A preallocated KV layer (B, heads, max_len, head_dim) written at the slots in one index buffer all layers
    share (a fixed address for captured graphs). `rows`: the batch rows in use, the first ones."""

    def __init__(self, max_cache_len: int, slots: torch.Tensor) -> None:
        super().__init__(max_cache_len)
        self.slots, self.rows = slots, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.slots[: key_states.shape[-2]]
        keys, values = self.keys[: self.rows], self.values[: self.rows]
        keys.index_copy_(2, index, key_states)
        values.index_copy_(2, index, value_states)
        return keys, values


class _Shape:
    """Every input of the static forward and commit of B rows of n-token trees, at fixed addresses for graphs."""

    def __init__(self, batch: int, n: int, max_len: int, style: MaskStyle, device: torch.device) -> None:
        self.ids, self.positions = (torch.zeros(batch, n, dtype=torch.long, device=device) for _ in range(2))
        self.mask = style.all_hidden((batch, 1, n, max_len), device)
        self.src = torch.zeros(batch, 1, max(n - 1, 1), 1, dtype=torch.long, device=device)  # commit: sources
        self.dst = torch.zeros(max(n - 1, 1), dtype=torch.long, device=device)  # commit: slots S+1 ... S+n-1
        self.scratch: dict[tuple, torch.Tensor] = {}  # commit: rows gathered per cache-layer shape
        self.outputs: dict[bool, tuple] = {}  # graphs: (logits, hidden) copied out, per want_hidden
        self.graphs: dict[object, torch.cuda.CUDAGraph] = {}  # want_hidden -> forward graph, "commit" -> commit


class TargetCache:
    """The target model plus one KV cache for B prompts, each row holding its committed sequence minus its root:
    prefill(ids, mask) -> tree_forward(tokens, tree) -> commit(paths) -> ...; decode(tokens) is a root-only round;
    drop_rows(keep) lets finished rows go. `static=None`: static storage where `use_static` allows it; its `max_len`
    must cover the padded prompts + max_new_tokens + the widest tree (a forward beyond it is refused).
    `integer_products`: the compiled CPU step multiplies a GGUF's coded weights as integers (`int_products.c`,
    llama.cpp's numerics) instead of the model's own float products; refused where that step does not apply."""

    def __init__(self, model: torch.nn.Module, static: bool | None = None, max_len: int | None = None,
                 graphs: bool = False, integer_products: bool = False, step: cpu_step.CpuStep | None = None) -> None:
        self.model, self.integer_products = model, integer_products
        self.device = next(model.parameters()).device
        self.static = use_static(model, self.device, static, max_len)
        # the compiled CPU step (static storage only: it writes the cache in place), exact by itself
        # (`step`: this model's step from a cache it outgrew, its packed weights reused)
        self.step = (step or cpu_step.CpuStep.of(model, integer=integer_products)
                     if self.static and self.device.type == "cpu" else None)
        if integer_products and (self.step is None or not self.step.has_integer_products):
            raise UnsupportedTargetError(
                f"integer products need the compiled CPU step over a GGUF's Q4_1 / Q8_0 weights (a Llama-family target "
                f"on a CPU, with a static cache); {type(model).__name__} here has "
                + ("no compiled step" if self.step is None else "no coded weights"))
        # a position's logits do not depend on how many tokens, or which rows, share its forward: by the compiled
        # step's construction, or a bf16/fp16 CPU model's preparation (`exact.prepare_target`; unprepared: refused)
        if self.step is None:
            require_prepared(model)
        self.exact = self.step is not None or is_prepared(model)
        self.style = MaskStyle(model, boolean=self.step is not None)
        self._cache_keyword = cache_keyword(model)
        if graphs and not (self.static and self.device.type == "cuda"):
            raise ValueError("graphs=True needs the static KV cache (static=True, max_len) on a CUDA device")
        self.use_graphs, self.max_len = graphs, (max_len if self.static else None)
        self._window = min(sliding_windows(model), default=None)
        self.forwards = 0
        self.cache = None
        self.slots = 0  # S: slots in use, common to all rows (a host int: masks are sized without a sync)
        self.positions = None  # (B,) long on device: each row's committed tokens in the cache (its root's position)
        self._valid = None  # (B, capacity) in mask form (visible / hidden); [:, :S] the valid slots
        self._pending = None  # the tree of the last tree forward, awaiting its commit
        self._dense = True  # every slot in use holds a token of every row (no pads, no holes): a host flag
        self._trees: dict[Tree, tuple[torch.Tensor, torch.Tensor]] = {}  # per tree: (mask block, depths) on device
        self.forward = model  # the static forward's model call (replaceable by a torch.compile'd forward)
        if self.static:
            self.key = weights_key(model), probe_key(model)
            self._arange = torch.arange(max_len, device=self.device)
            self._write = torch.zeros(max_len, dtype=torch.long, device=self.device)  # slots the next forward writes
            self.cache = Cache(layers=[_SlotLayer(max_len, self._write) for _ in cache_layers(model)])
            self._shapes: dict[tuple[int, int], _Shape] = {}
            self._pool = None  # one memory pool for all graphs

    @classmethod
    def for_call(cls, model: torch.nn.Module, max_len: int, graphs: bool = True,
                 kept: TargetCache | None = None, integer_products: bool = False) -> TargetCache:
        """The cache of one generate call: a fresh dynamic one where static storage does not apply, else `kept` (the
        static cache of an earlier call, which the caller keeps) while it has room and the model's weights,
        attention, dtype and device are unchanged, or a new static one."""
        device = next(model.parameters()).device
        if not use_static(model, device, None, max_len):
            return cls(model, static=False, integer_products=integer_products)
        graphs = graphs and device.type == "cuda"
        same = (kept is not None and kept.static and kept.model is model and kept.integer_products == integer_products
                and kept.key == (weights_key(model), probe_key(model)))
        if not same or kept.max_len < max_len or kept.use_graphs != graphs:
            kept = cls(model, static=True, max_len=max_len, graphs=graphs, integer_products=integer_products,
                       step=kept.step if same else None)
        return kept

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def valid(self) -> torch.Tensor:
        """(B, slots) bool: slot j holds a committed token of row b."""
        return self._valid[:, : self.slots] == self.style.visible

    def _tree_inputs(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's own mask block and depths, moved to the device once per tree."""
        if tree not in self._trees:
            self._trees[tree] = self.style.block(tree, self.device), torch.tensor(tree.depths, device=self.device)
        return self._trees[tree]

    def _reserve(self, slots: int) -> None:
        """Room for `slots` columns: within the static storage (squeezing out the holes when full), or in the dynamic
        validity buffer, grown geometrically; never past a sliding window."""
        if self.static:
            if slots > self.max_len:
                slots -= self.slots - self._compact()
            if slots > self.max_len:
                raise ValueError(f"the static KV cache holds {self.max_len} tokens but this forward needs {slots}: "
                                 "pass max_len >= padded prompt + max_new_tokens + the widest tree's node count + 1")
        elif slots > self._valid.shape[1]:
            grown = self.style.all_hidden((self._valid.shape[0], max(slots, 2 * self._valid.shape[1])), self.device)
            grown[:, : self.slots] = self._valid[:, : self.slots]
            self._valid = grown
        if self._window is not None and slots > self._window:
            raise ValueError(f"the batch cache needs {slots} slots, beyond the {self._window} that "
                             f"{type(self.model).__name__}'s sliding-window cache holds exactly")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Encode left-padded prefixes (B, L) into a fresh cache -> the last column's logits (B, V) (None if L = 0).
        An all-pad row (a one-token prompt's prefix) starts empty; every query sees itself: its logits stay finite."""
        input_ids = input_ids.to(self.device)
        batch, length = input_ids.shape
        valid = (torch.ones(input_ids.shape, dtype=torch.bool, device=self.device) if attention_mask is None
                 else attention_mask.to(device=self.device, dtype=torch.bool))
        self.positions = valid.sum(dim=1)
        self.slots, self._pending, self.forwards = 0, None, 0  # a new sequence (a reused static cache counts anew)
        if self.static:  # a new sequence: the storage is re-allocated (graphs dropped) when the batch outgrows it
            for layer in self.cache.layers:
                if layer.is_initialized and layer.keys.shape[0] < batch:
                    layer.is_initialized = False
                    self._shapes.clear()
                layer.rows = batch
            self._write[:length].copy_(self._arange[:length])  # the prompts go to slots 0..L-1
        else:
            self.cache = DynamicCache(config=self.model.config)
        self._valid = self.style.all_hidden((batch, self.max_len or max(length, 1)), self.device)
        if length == 0:
            return None
        self._reserve(length)
        # without pads a dynamic cache needs no mask: transformers' own causal one takes sdpa's faster path
        self._dense = attention_mask is None or bool(valid.all())  # the call's one sync, before any round
        if self.exact:
            logits = self._prefill_rows(input_ids, valid)
        else:
            mask = None
            if self.static or not self._dense:  # each row's causal mask over its own tokens, (B, 1, L, max_len or L)
                seen = torch.ones(length, length, dtype=torch.bool, device=self.device).tril_() & valid[:, None, :]
                seen |= torch.eye(length, dtype=torch.bool, device=self.device)
                mask = self.style.all_hidden((batch, 1, length, self.max_len or length), self.device)
                mask[:, 0, :, :length].masked_fill_(seen, self.style.visible)
            logits = self.model(input_ids=input_ids, attention_mask=mask,
                                position_ids=(valid.cumsum(dim=1) - 1).clamp_(min=0),  # pads do not count
                                **{self._cache_keyword: self.cache}, use_cache=True,
                                **last_logits_only(self.model)).logits[:, -1]
        self._valid[:, :length].masked_fill_(valid, self.style.visible)
        self.slots = length
        self.forwards += 1
        return logits

    def _prefill_rows(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """An exact target's prefill: each row's prompt in a call of its own, its keys and values stored right-aligned
        behind its pads. A prompt of up to STEP_PREFILL tokens with integer products goes through the compiled step
        (`_step_prefill`); any other through transformers' forward (`prefilling`: fast kernels). Which one depends on
        the prompt alone, so a prompt gets the same bits alone or in any batch."""
        batch, length = input_ids.shape
        if self.step is not None:
            self._storage()
        logits, caches = None, [None] * batch
        for b in range(batch):
            tokens = input_ids[b][valid[b]]
            if tokens.numel() == 0:  # a one-token prompt's empty prefix: nothing cached, no logits
                continue
            if self.integer_products and tokens.numel() <= STEP_PREFILL:
                out = self._step_prefill(b, tokens, length)
            else:
                caches[b] = DynamicCache(config=self.model.config)
                with prefilling(self.model):
                    out = self.model(input_ids=tokens[None], **{self._cache_keyword: caches[b]}, use_cache=True,
                                     **last_logits_only(self.model)).logits[0, -1]
            if logits is None:  # (B, V), zeros for rows without a prefix
                logits = out.new_zeros(batch, out.shape[-1])
            logits[b] = out
        if logits is None:
            raise ValueError("prefill needs at least one row with a token that is not padding")
        if any(cache is not None for cache in caches):
            self._store(caches, length)
        return logits

    def _step_prefill(self, b: int, tokens: torch.Tensor, length: int) -> torch.Tensor:
        """Row b's prompt `tokens` through the compiled step in one call, into slots [length - n, length), the head's
        products for its last token only -> its logits (V,). A token's bits do not depend on the tokens sharing its
        call: this is the prompt decoded token by token. Integer products over many rows run 3x transformers' float
        prefill at 50 tokens, 1.2x at 400 (SmolLM2-135M, 2 cores); past ~500 the step's attention, a query at a time,
        costs more than the products save."""
        n, start = tokens.numel(), length - tokens.numel()
        mask = torch.zeros(1, 1, n, length, dtype=torch.bool)
        mask[0, 0, :, start:] = torch.ones(n, n, dtype=torch.bool).tril_()
        keys, values = ([getattr(layer, name)[b : b + 1] for layer in self.cache.layers] for name in ("keys", "values"))
        logits, _ = self.step.forward(tokens[None], mask, self._arange[None, :n], self._arange[start:length], length,
                                      keys, values, False, last=True)
        return logits[0, 0]

    def _store(self, caches: list, length: int) -> None:
        """Rows' prefill caches (None: a row without one) into this cache, right-aligned to `length` slots (the
        compiled step's storage in place: rows the step prefilled are stored already)."""
        for index, layer in enumerate(self.cache.layers):
            if self.step is not None:
                keys, values = layer.keys, layer.values
            else:
                first = next(cache.layers[index] for cache in caches if cache is not None)
                keys, values = (t.new_zeros(len(caches), t.shape[1], length, t.shape[3])
                                for t in (first.keys, first.values))
            for b, cache in enumerate(caches):
                if cache is not None:
                    n = cache.layers[index].keys.shape[2]
                    keys[b, :, length - n : length] = cache.layers[index].keys[0]
                    values[b, :, length - n : length] = cache.layers[index].values[0]
            if self.step is None:
                self.cache.update(keys, values, index)

    def _storage(self) -> None:
        """The compiled step's static storage for the batch's rows (a prefill that cached nothing leaves none)."""
        for layer in self.cache.layers:
            if not layer.is_initialized:
                k = torch.zeros(self.batch_size, self.step.struct.kv_heads, 1, self.step.struct.head_dim,
                                dtype=self.step.dtype)
                layer.lazy_initialization(k, k)

    @torch.no_grad()
    def tree_forward(self, tokens: torch.Tensor, tree: Tree, want_hidden: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward of every row's tree: tokens (B, T+1) in `tree`'s node order, tokens[:, 0] the roots.
        Row b's node i sees row b's valid slots and its ancestors, at position positions[b] + depth(i).
        Returns logits (B, T+1, V) and, if asked, final hidden states (B, T+1, H); then `commit`."""
        n, batch = len(tree), self.batch_size
        if tokens.shape != (batch, n):
            raise ValueError(f"tree_forward needs tokens of shape ({batch}, {n}), got {tuple(tokens.shape)}")
        self._reserve(self.slots + n)
        self._pending = tree
        self.forwards += 1
        if self.static:
            return self._static_forward(tokens, tree, want_hidden)
        block, depths = self._tree_inputs(tree)
        mask = None  # a decoding step over a cache without pads or holes sees every slot: the causal default
        if n > 1 or not self._dense:
            mask = torch.empty(batch, 1, n, self.slots + n, dtype=self.style.dtype, device=self.device)
            mask[:, 0, :, : self.slots] = self._valid[:, None, : self.slots]
            mask[:, 0, :, self.slots :] = block
        return self._call(self.model, tokens, mask, self.positions[:, None] + depths, want_hidden)

    def _call(self, forward, ids: torch.Tensor, mask, positions: torch.Tensor, want_hidden: bool):
        out = forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                      **{self._cache_keyword: self.cache}, use_cache=True, output_hidden_states=want_hidden)
        return out.logits, out.hidden_states[-1] if want_hidden else None

    def commit(self, paths: list[list[int]]) -> None:
        """Keep each row's root + accepted `paths[b]` (node indices in depth order) of the last tree forward: the
        path's nodes move right after the root, slots past them up to the longest path are holes of that row."""
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
        n, longest = len(tree), max(map(len, paths))
        self._dense = self._dense and all(len(path) == longest for path in paths)  # shorter paths leave holes
        self._valid[:, root] = self.style.visible
        if not longest:  # a root-only round (decode), or nothing accepted: no slot to move, no copy to the device
            self.positions += 1
        else:
            span = n - 1 if self.static else longest  # static: fixed shapes per tree size (self-copies past a path)
            # the round's one host -> device copy: each row's source slots, then its path length
            index = torch.tensor([[root + i for i in path] + list(range(root + 1 + len(path), root + 1 + span))
                                  + [len(path)] for path in paths])
            index = to_device(index, self.device)
            kept = index[:, -1]
            if any(path != list(range(1, len(path) + 1)) for path in paths):  # chains from node 1 are in place
                self._move(index[:, :-1], root, n)
            holes = torch.arange(span, device=self.device) >= kept[:, None]
            self._valid[:, root + 1 : root + 1 + span] = self.style.visible
            self._valid[:, root + 1 : root + 1 + span].masked_fill_(holes, self.style.hidden)
            self.positions += 1 + kept
        if not self.static and n - 1 - longest:
            self.cache.crop(-(n - 1 - longest))
        self.slots = root + 1 + longest

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (B,) -> the logits after it (B, V): a root-only tree forward and its commit."""
        logits, _ = self.tree_forward(tokens.view(-1, 1), ROOT_ONLY)
        self.commit([[]] * self.batch_size)
        return logits[:, 0]

    def drop_rows(self, keep) -> None:
        """Keep only rows `keep` (increasing row indices); a dynamic cache, copied anyway, also drops the slots no
        remaining row uses."""
        keep = torch.as_tensor(keep, dtype=torch.long).flatten()
        if keep.numel() == 0:
            raise ValueError("drop_rows needs at least one row to keep")
        if (keep < 0).any() or (keep >= self.batch_size).any() or (keep[1:] <= keep[:-1]).any():
            raise ValueError(f"drop_rows needs increasing row indices in [0, {self.batch_size}), got {keep.tolist()}")
        if self._pending is not None:
            raise ValueError("drop_rows after a tree_forward needs its commit first")
        keep = keep.to(self.device)
        self._valid, self.positions = self._valid[keep], self.positions[keep]
        if self.static:  # the kept rows move to the first rows of the storage (index_select reads before the copy)
            for layer in self.cache.layers:
                if layer.is_initialized:  # not before a first forward (an empty prefill): nothing stored yet
                    layer.keys[: keep.numel()].copy_(layer.keys.index_select(0, keep))
                    layer.values[: keep.numel()].copy_(layer.values.index_select(0, keep))
                layer.rows = keep.numel()
            return
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
            self._valid[:, : self.slots] = self._valid[:, cols]
        self._dense = bool(self.valid.all())  # dropped rows may have taken every pad and hole with them

    def _compact(self) -> int:
        """Move every row's valid slots to the front of the full static storage, in order (in place: graphs stay
        valid; one host sync) -> the new slot count. Slower rows' holes would outgrow `max_len`; their tokens do not."""
        valid = self.valid
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid slots first, in order
        counts = valid.sum(dim=1)
        slots = int(counts.max())
        index = order[:, None, :slots, None]
        for layer in self.cache.layers:
            if layer.is_initialized:
                for kv in (layer.keys[: layer.rows], layer.values[: layer.rows]):  # gathered before the write:
                    kv[:, :, :slots] = torch.take_along_dim(kv[:, :, : self.slots], index, dim=2)
        kept = self._arange[: self.slots] < counts[:, None]
        self._valid[:, : self.slots] = self.style.hidden
        self._valid[:, : self.slots].masked_fill_(kept, self.style.visible)
        self.slots = slots
        return slots

    def _move(self, sources: torch.Tensor, root: int, n: int) -> None:
        """Slots root+1 ... of every row take that row's `sources` (B, span), gathered before the write."""
        span = sources.shape[1]
        if not self.static:
            for layer in self.cache.layers:
                for kv in (layer.keys, layer.values):
                    kv[:, :, root + 1 : root + 1 + span] = torch.take_along_dim(kv, sources[:, None, :, None], dim=2)
            return
        shape = self._shape(n)
        shape.src.view(shape.src.shape[0], -1).copy_(sources)
        torch.add(self._arange[1:n], root, out=shape.dst)
        if not self.use_graphs:
            return self._static_move(shape)
        if "commit" not in shape.graphs:
            sources = shape.src.clone()
            shape.src.copy_(shape.dst.view(1, 1, -1, 1).expand_as(shape.src))  # warm-up runs must move nothing
            shape.graphs["commit"] = self._capture(lambda: self._static_move(shape))
            shape.src.copy_(sources)
        shape.graphs["commit"].replay()

    def _static_move(self, shape: _Shape) -> None:
        for layer in self.cache.layers:
            for kv in (layer.keys[: layer.rows], layer.values[: layer.rows]):
                key = (kv.shape[1], kv.shape[3], kv.dtype)
                if key not in shape.scratch:
                    shape.scratch[key] = kv.new_empty(kv.shape[0], kv.shape[1], shape.dst.numel(), kv.shape[3])
                index = shape.src.expand(-1, kv.shape[1], -1, kv.shape[3])
                torch.gather(kv, 2, index, out=shape.scratch[key])
                kv.index_copy_(2, shape.dst, shape.scratch[key])

    def _shape(self, n: int) -> _Shape:
        key = (self.batch_size, n)
        if key not in self._shapes:
            self._shapes[key] = _Shape(self.batch_size, n, self.max_len, self.style, self.device)
        return self._shapes[key]

    def _static_forward(self, tokens: torch.Tensor, tree: Tree, want_hidden: bool):
        """Fill the (B, n) buffers (ids, positions, write slots [S, S+n), mask), then run the forward or its graph."""
        n, start = len(tree), self.slots
        shape = self._shape(n)
        block, depths = self._tree_inputs(tree)
        shape.ids.copy_(tokens)
        torch.add(self.positions[:, None], depths, out=shape.positions)
        torch.add(self._arange[:n], start, out=self._write[:n])
        shape.mask[:, 0] = self._valid[:, None, :]
        shape.mask[:, 0, :, start : start + n] = block
        if self.step is not None:
            self._storage()
            layers = self.cache.layers
            return self.step.forward(shape.ids, shape.mask, shape.positions, self._write[:n], start + n,
                                     [layer.keys for layer in layers], [layer.values for layer in layers], want_hidden)
        if not self.use_graphs:
            return self._call(self.forward, shape.ids, shape.mask, shape.positions, want_hidden)
        if want_hidden not in shape.graphs:
            def forward_into() -> None:  # outputs copied to buffers of their own, out of reach of other graphs' replays
                outputs = self._call(self.forward, shape.ids, shape.mask, shape.positions, want_hidden)
                if want_hidden not in shape.outputs:
                    shape.outputs[want_hidden] = tuple(t if t is None else torch.empty_like(t) for t in outputs)
                for out, t in zip(shape.outputs[want_hidden], outputs):
                    if out is not None:
                        out.copy_(t)

            shape.graphs[want_hidden] = self._capture(forward_into)
        shape.graphs[want_hidden].replay()
        return shape.outputs[want_hidden]

    def _capture(self, body) -> torch.cuda.CUDAGraph:
        """Capture `body` into the shared pool; the caller makes its warm-up runs harmless."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(body, self._pool, self.device)


def use_static(model: torch.nn.Module, device: torch.device, static: bool | None, max_len: int | None) -> bool:
    """Resolve TargetCache's `static` argument; refuse a bad `max_len` or a static cache the model cannot use."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int (KV slots to preallocate), got {max_len!r}")
    if static is None:  # auto: static on CUDA (capturable) and for the compiled CPU step; else a CPU's dynamic cache
        return ((device.type == "cuda" or cpu_step.applies(model)) and max_len is not None  # is as fast or faster
                and static_cache_refusal(model, max_len) is None)
    if static:
        if max_len is None:
            raise ValueError("static=True needs max_len: prompt + max_new_tokens + the widest tree's node count + 1")
        reason = static_cache_refusal(model, max_len)
        if reason is not None:
            raise UnsupportedTargetError(reason)
    return bool(static)
