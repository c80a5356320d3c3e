"""A Transformer drafter: any Hugging Face causal LM behind `MambaDrafter`'s interface, on a `KVState` (one KV cache
per row; forking a row copies its cache). A forward attends with a 4D mask by position, so rows of different lengths
step together without padding: full-attention models only (a sliding window needs HF's own mask). A Llama-family
model runs `llama_step`'s lean body where a probe shows transformers' logits.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from .checkpoint import DRAFT_VOCAB, check_draft_ids, read_draft_ids
from .ids import SharedCalls, check_batch
from .kv_state import KVState, KVStore, write_rows
from .llama_step import LlamaBody
from .packed_linear import PackCache
from .targets.facts import attn_implementation, cache_keyword, last_logits_only, sliding_windows

INITIAL_SLOTS = 256  # first capacity of a state's caches; doubled when a row outgrows it
# config fields of models whose logits are not (head x final hidden state): a draft head would skip that step
HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _close(probed: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether a probe's logits are the reference's up to the rounding of another order of products."""
    return torch.allclose(probed, reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max()) + 1e-6)


class _RowLayer(CacheLayerMixin):
    """One layer's cache for one forward: writes the new keys at each row's own slots, returns the used slots."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, starts: list[int], positions: torch.Tensor,
                 width: int) -> None:
        super().__init__()
        self.keys, self.values, self.starts, self.positions, self.width = keys, values, starts, positions, width
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the storage exists already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        write_rows(self.keys, key_states, self.starts, self.positions)
        write_rows(self.values, value_states, self.starts, self.positions)
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]

    def get_seq_length(self) -> int:
        return self.width

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.width, 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class TransformerDrafter(SharedCalls, nn.Module):
    """A Hugging Face causal LM as a drafter: implements `mamba_draft.drafter.Drafter`, as `MambaDrafter` does."""

    capturable = False  # a forward's width follows the longest row: eager only
    reads_target = False  # token ids only
    backend = "hf"
    state_dtype = None

    def __init__(self, model: nn.Module, draft_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder; a drafter must be a decoder-only "
                             "causal LM")
        self.model = model.eval()
        self.config = config
        if sliding_windows(model):
            raise ValueError(f"{type(model).__name__} has sliding-window attention layers; the Transformer drafter "
                             "supports full-attention models only")
        # the 4D mask each attention implementation takes: sdpa a boolean one, the others an additive one
        self._bool_mask = attn_implementation(model) == "sdpa"
        self._last_logits = last_logits_only(model)  # `logits_to_keep=1` where the forward takes it
        self._cache_keyword = cache_keyword(model)
        for name in ("draft_ids", "draft_head", "draft_bias"):
            self.register_buffer(name, None, persistent=False)
        self.head_cache = PackCache()  # the draft head's (or the model's head's) prepacked copy (bf16 on CPU)
        self.lean: LlamaBody | None = self._checked_lean_body()
        self.set_draft_vocab(draft_ids)

    @classmethod
    def from_pretrained(cls, path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        revision: str | None = None) -> TransformerDrafter:
        """A local HF causal-LM directory or hub id (sdpa attention), with the draft vocabulary a directory stores;
        OSError (the first sentence of the reason) if transformers cannot load it, ValueError for a bad vocabulary."""
        try:
            model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype,
                                                         attn_implementation="sdpa")
        except (ValueError, OSError, KeyError) as err:  # transformers' message runs to a paragraph: its first sentence
            raise OSError(str(err).split(". ")[0].strip()) from err
        drafter = cls(model.to(device))
        try:
            drafter.set_draft_vocab(read_draft_ids(path))  # None for a hub id
        except ValueError as err:
            raise ValueError(f"{Path(path) / DRAFT_VOCAB}: {err}") from err
        return drafter

    @torch.no_grad()
    def set_draft_vocab(self, draft_ids: torch.Tensor | None) -> None:
        """Propose only `draft_ids` (distinct ids of the head's vocabulary), or every id with None. Refused where
        the logits are not the head applied to the final hidden state (soft-capped or scaled): it would differ."""
        if draft_ids is None:
            self.draft_ids = self.draft_head = self.draft_bias = None
            return
        head = self.model.get_output_embeddings()
        ids = check_draft_ids(draft_ids, int(head.weight.shape[0]), head.weight.device)
        transforms = [name for name in HEAD_TRANSFORMS if getattr(self.config, name, None) not in (None, 1, 1.0)]
        if transforms:
            raise ValueError(f"{type(self.model).__name__} transforms its logits ({', '.join(transforms)}): a draft "
                             "vocabulary would score its ids differently; use the full vocabulary")
        bias = getattr(head, "bias", None)
        draft_head, draft_bias = head.weight[ids].detach().clone(), None if bias is None else bias[ids].detach().clone()
        # the body's last hidden state times the head rows must be the model's own logits: check on a probe
        probe = torch.arange(4, device=ids.device)[None] % self.input_vocab_size
        full = self.model(input_ids=probe).logits[..., ids].float()
        drafted = F.linear(self.model.base_model(input_ids=probe).last_hidden_state, draft_head, draft_bias).float()
        if not _close(drafted, full):
            raise ValueError(f"{type(self.model).__name__}'s logits are not its head applied to its body's last "
                             "hidden state: a draft vocabulary cannot be used with it")
        self.draft_ids, self.draft_head, self.draft_bias = ids, draft_head, draft_bias

    @torch.no_grad()
    def _checked_lean_body(self) -> LlamaBody | None:
        """`llama_step`'s lean body if the model has the Llama layout and the body gives transformers' logits on a
        probe (two rows of different lengths reading a block of three tokens), else None."""
        body = LlamaBody.of(self.model)
        if body is None:
            return None
        probe = torch.arange(13, device=self.device) * 7 % self.input_vocab_size
        logits = []
        for lean in (None, body):
            self.lean = lean
            _, state = self.prefill(probe[:10].view(2, 5))
            state.lengths[1] = 3  # row 1 continues after 3 tokens: rows of different lengths in one forward
            logits.append(self.extend(probe[10:].expand(2, 3), state).float())
        self.lean = None
        return body if _close(logits[1], logits[0]) else None

    @property
    def vocab_size(self) -> int:
        """Width of the logits: the draft vocabulary's size, else the output embedding's rows."""
        rows = self.model.get_output_embeddings().weight.shape[0]
        return self.draft_ids.numel() if self.draft_ids is not None else int(rows)

    @property
    def input_vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    embedding_rows = input_vocab_size  # ids `prefill` / `extend` accept: every embedding row

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", None) or 2**20)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's, except fp32 where the lean body attends on CPU (there few-row bf16
        batched products, or converting the used slots each step, cost more than fp32 products on an fp32 cache)."""
        return torch.float32 if self.lean is not None and self.device.type == "cpu" else self.dtype

    def row_bytes(self, context: int) -> int:
        """Bytes of one state row holding `context` tokens (keys and values, every layer)."""
        return context * self.cache_dtype.itemsize * sum(h * (k + v) for h, k, v in self._layer_shapes)

    @functools.cached_property
    def _layer_shapes(self) -> list[tuple[int, int, int]]:
        """(kv heads, key dim, value dim) per layer, read off one token's cache (any HF architecture)."""
        cache = DynamicCache(config=self.config)
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                       **{self._cache_keyword: cache}, use_cache=True)
        return [(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]) for layer in cache.layers]

    def allocate_state(self, max_batch: int) -> KVState:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        slots = min(INITIAL_SLOTS, self.max_positions)
        zeros = lambda heads, dim: torch.zeros(max_batch, heads, slots, dim, dtype=self.cache_dtype, device=self.device)
        shapes = self._layer_shapes
        return KVState(KVStore([zeros(h, k) for h, k, _ in shapes], [zeros(h, v) for h, _, v in shapes],
                                torch.zeros(max_batch, dtype=torch.long, device=self.device), self.max_positions))

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, state: KVState, *, last_only: bool = False) -> torch.Tensor:
        ids = self.token_ids(input_ids)
        n = ids.shape[1]
        rows = state.rows(0, check_batch(ids.shape[0], state))
        lengths = rows.lengths
        starts = lengths.tolist()  # each row's first new slot (a host sync: this drafter is eager)
        width = max(starts) + n  # the longest row's slots after this block
        rows.store.reserve(width)
        positions = lengths[:, None] + torch.arange(n, device=self.device)  # (B, n): slot = position
        # query t of row b sees slots [0, its position]: its row's cache (contiguous from 0) and the block so far
        visible = torch.arange(width, device=self.device) <= positions[:, :, None]
        keys, values = ([t[rows.start:rows.stop] for t in ts] for ts in (rows.store.keys, rows.store.values))
        if self.lean is not None:
            hidden = self.lean.forward(ids, starts, positions, visible, keys, values)
        else:
            mask = visible[:, None]
            if not self._bool_mask:  # an additive mask
                mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                    ~mask, torch.finfo(self.dtype).min)
            cache = Cache(layers=[_RowLayer(k, v, starts, positions, width) for k, v in zip(keys, values)])
            kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          **{self._cache_keyword: cache})
            if self.draft_head is None:  # the model's own head (and logit transforms)
                out = self.model(**kwargs, **(self._last_logits if last_only else {}))
                lengths += n
                return out.logits[:, -1] if last_only else out.logits
            hidden = self.model.base_model(**kwargs).last_hidden_state
        lengths += n
        head = self.model.get_output_embeddings()
        weight, bias = (head.weight, head.bias) if self.draft_head is None else (self.draft_head, self.draft_bias)
        return self.head_cache.linear(hidden[:, -1] if last_only else hidden, weight, bias)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, state: KVState) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError("step takes one token per row: a tensor of shape (B,)")
        return self.extend(token_ids[:, None], state, last_only=True)
