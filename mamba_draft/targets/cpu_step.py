"""The compiled CPU step of Llama-family targets (Llama, SmolLM, Mistral without a window, Qwen2): a decoding step
or a tree's verification in one C call (`cpu_step.c`) over the engine's static KV cache, exact by construction (a
token's logits are the same bits however many rows share the call), for fp32, bf16 and fp16 weights.

transformers' eager step spends most of a small model's time in Python and dispatch between ~15 small operations a
layer; the C step runs the layers back to back, each product one pass over a copy of its weight packed for it
(`encode`): a GGUF's 4-bit and 8-bit weights, which transformers dequantizes to floats, are read as their codes and
scales and rebuilt exactly in the kernel, so a decoding step reads about the file's bytes (a fifth of float32's).
The library is built once per machine by `native.build` and cached on disk. `CpuStep.of(model)` is None for a model
of another layout, for a model off the CPU, where no C compiler builds the step (said once, in one line), or with
MAMBA_DRAFT_CPU_STEP=0; it checks its logits against the model's own on a probe before it is used.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import torch
from torch import nn

from .native import KernelUnavailable, build, loads
from .row_attention import DTYPES

SOURCE = Path(__file__).with_name("cpu_step.c")
MODEL_TYPES = ("llama", "mistral", "qwen2")  # RMSNorm, rotary embedding, SiLU-gated MLP, nothing else that acts
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}  # and its activation `act_fn`, a module or a function
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
LANES = 16  # cpu_step.c: the output rows of a packed weight block
GROUP = 32  # cpu_step.c: the inputs that share a scale in a coded weight (a GGUF block)
PROBE_TOLERANCE = 0.05  # the probe's largest logit difference, relative to the logits' spread (sum order only)
SWITCH = "MAMBA_DRAFT_CPU_STEP"  # "0": transformers' eager step everywhere (comparisons, debugging)


class Weight(ctypes.Structure):
    """cpu_step.c's Weight: a product's weight as `encode` lays it out, its code width, and whether it is multiplied
    as integers (`int_products.c`)."""

    _fields_ = [("data", ctypes.c_void_p), ("codes", ctypes.c_int), ("integer", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), *[(name, Weight) for name in ("q", "k", "v")],
                *[(name, ctypes.c_void_p) for name in ("q_bias", "k_bias", "v_bias")], ("o", Weight),
                ("o_bias", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                *[(name, Weight) for name in ("gate", "up", "down")],
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int) for name in (
        "layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "tokens", "dtype", "slots")],
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("head", Weight),
        ("layer", ctypes.POINTER(_Layer))]


@functools.cache
def library() -> ctypes.CDLL:
    return declare(build(SOURCE, "the compiled target step"))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    lib.cpu_step_forward.argtypes = [ctypes.POINTER(_Model), i32, i32, pointer, pointer, pointer, pointer, pointer,
                                     ctypes.POINTER(ctypes.c_int64), i32, i32, pointer, pointer, pointer, i32]
    lib.cpu_step_forward.restype = i32
    lib.cpu_linear.argtypes = [pointer, i32, i32, ctypes.POINTER(Weight), pointer, i32, pointer, i32, i32]
    lib.cpu_linear.restype = i32
    lib.cpu_step_work.argtypes = [ctypes.POINTER(_Model), i32]
    lib.cpu_step_work.restype = ctypes.c_int64
    return lib


@functools.cache
def available() -> bool:
    """Whether the library builds (or is found) and loads here: asked once, so a failed build is not retried on
    every product that asks (`mamba_draft.row_linear`)."""
    return loads(library)


@functools.cache
def _compiler_missing(reason: str) -> None:
    print(f"mamba-draft: {reason}; the target runs transformers' eager step instead", file=sys.stderr)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A product's weight (out, in) in the kernel's layout: blocks of 16 output rows, each stored column by column
    (in, 16), so a product reads 16 outputs' weights for one input in one load."""
    out, inner = weight.shape
    return weight.reshape(out // LANES, LANES, inner).transpose(1, 2).contiguous()


def encode(weight: torch.Tensor, integer: bool = False) -> tuple[torch.Tensor, int]:
    """A product's weight (out, in) as the kernel reads it, with its code width (`cpu_step.c`'s Weight): where every
    group of 32 inputs of a row holds values dtype(scale * code + offset) with a 4-bit code (or scale * code with a
    signed 8-bit code) and a float16 scale — what a GGUF's Q4_1 / Q8_0 weights become when transformers dequantizes
    them — the codes and scales, 1/5 or 1/3.5 of the float32 bytes, found here and checked value by value (`integer`:
    the codes in the order of `int_products.c`, for integer products); else, for a float32 weight of bfloat16 values
    (a bf16 checkpoint loaded in fp32), `pack`ed in bf16 (16); else `pack(weight)` (0). The kernel reads back the very
    values, so the products' bits do not change."""
    weight = weight.detach()
    if weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % GROUP == 0:
        for bits in (4, 8):
            tiles = _coded(weight, bits, integer)
            if tiles is not None:
                return tiles, bits
    if weight.dtype == torch.float32 and torch.equal(weight.bfloat16().float(), weight):
        return pack(weight.bfloat16()), 16
    return pack(weight), 0


def _coded(weight: torch.Tensor, bits: int, integer: bool) -> torch.Tensor | None:
    """`weight`'s tiles (`_tiles`) at `bits` bits, or None if a value is not of that form."""
    out, inner = weight.shape
    values = weight.float().view(out, inner // GROUP, GROUP)
    if bits == 4:
        offset, low, high = values.amin(-1, keepdim=True), 0, 15
        guess = (values.amax(-1, keepdim=True) - offset) / high
    else:
        offset, low, high = torch.zeros(out, inner // GROUP, 1), -128, 127
        guess = values.abs().amax(-1, keepdim=True) / high
    guess = guess.to(torch.float16)  # the scale's nearest float16, then its two neighbours
    shifted = values - offset if bits == 4 else values
    found = None
    for step in (0, -1, 1):
        candidate = (guess.view(torch.int16) + step).view(torch.float16).float()
        code = torch.div(shifted, candidate).round_().nan_to_num_(0.0).clamp_(low, high)
        rebuilt = torch.addcmul(offset, candidate, code)  # scale * code is exact: one rounding, as the kernel's
        if weight.dtype == torch.bfloat16:
            rebuilt = rebuilt.to(torch.bfloat16).float()
        fits = (rebuilt == values).all(-1, keepdim=True)
        if found is None:
            if float(fits.float().mean()) < 0.5:
                return None  # values of another form (8-bit codes, plain weights): spare the neighbours' tries
            scale, codes, found = torch.zeros_like(candidate), torch.zeros_like(code), torch.zeros_like(fits)
        fits &= ~found
        scale, codes = torch.where(fits, candidate, scale), torch.where(fits, code, codes)
        found |= fits
        if bool(found.all()):
            return _tiles(codes, scale, offset, bits, integer)
    return None


def quantized(weight: torch.Tensor) -> torch.Tensor:
    """Integer tiles (8-bit codes, `int_products.c`) of any weight (out, in), in % 16 == in % 32 == 0: per row and
    group of 32 inputs the scale max |w| / 127 and the nearest codes, as llama.cpp's Q8_0 quantizes (a drafter's
    products: its proposals are verified, so they may round so)."""
    out, inner = weight.shape
    values = weight.detach().float().view(out, inner // GROUP, GROUP)
    scale = values.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, values / scale, 0.0).round_().clamp_(-127, 127)
    return _tiles(codes, scale, None, 8, integer=True)


def _tiles(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
           integer: bool) -> torch.Tensor:
    """The kernel's tiles from codes (out, groups, 32) and per-group scales (and 4-bit offsets) (out, groups, 1): per
    block of 16 output rows and group of 32 inputs, 16 fp32 scales, 16 fp32 offsets for 4 bits, then the codes input
    by input, or with `integer` in dot-product order (`int_products.c`)."""
    out, inner = codes.shape[0], codes.shape[1] * GROUP
    codes = codes.to(torch.int16)
    blocks = out // LANES
    by_input = codes.view(blocks, LANES, inner // GROUP, GROUP).permute(0, 2, 3, 1)  # (blocks, groups, 32, 16)
    if integer:  # byte q * 64 + n * 4 + r: output n, input 4q + r (4 bits: the high nibble input 16 + 4q + r)
        quads = by_input.reshape(blocks, inner // GROUP, GROUP // 4, 4, LANES).transpose(3, 4)  # (.., q, n, r)
        if bits == 4:
            packed = (quads[:, :, :4] | quads[:, :, 4:] << 4).to(torch.uint8)
        else:
            packed = (quads + 128).to(torch.uint8)
    elif bits == 4:
        packed = (by_input[..., : LANES // 2] | by_input[..., LANES // 2:] << 4).to(torch.uint8)
    else:
        packed = by_input.to(torch.int8).view(torch.uint8)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # (out, groups, 1) floats -> (blocks, groups, 64) bytes
        return t.float().view(blocks, LANES, inner // GROUP).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [per_block(scale), *([per_block(offset)] if bits == 4 else []), packed.reshape(blocks, inner // GROUP, -1)]
    return torch.cat(parts, dim=-1).contiguous()


def llama_layout(model: nn.Module) -> bool:
    """Whether `model` is a Llama-family causal LM the C step computes (and nothing else acts in its modules)."""
    config = model.config
    body = getattr(model, "model", None)
    if (config.model_type not in MODEL_TYPES or body is None or getattr(config, "hidden_act", None) != "silu"
            or not hasattr(body, "rotary_emb") or getattr(config, "sliding_window", None) and getattr(
                config, "use_sliding_window", config.model_type == "mistral")
            or getattr(config, "mlp_bias", False) or not isinstance(model.get_output_embeddings(), nn.Linear)
            or model.get_output_embeddings().bias is not None):
        return False
    norms = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
    return all(llama_layer(layer) and type(layer.input_layernorm).__name__ in norms
               and type(layer.post_attention_layernorm).__name__ in norms for layer in body.layers)


def llama_layer(layer: nn.Module) -> bool:
    """Whether a decoder layer has the Llama layout: two norms, attention by four linear products with a `scaling`
    and no window, a gated MLP, and nothing else that acts (`llama_step.LlamaBody` reads it too)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return ({name for name, _ in layer.named_children()} == _LAYER
            and {n for n, _ in attn.named_children()} == _ATTENTION
            and {n for n, _ in mlp.named_children()} - {"act_fn"} == _MLP
            and all(isinstance(getattr(attn, n), nn.Linear) for n in _ATTENTION)
            and hasattr(attn, "scaling") and not getattr(attn, "sliding_window", None))


def applies(model: nn.Module) -> bool:
    """Whether the step computes `model` here, cheaply (`CpuStep.of` also probes it): a contiguous Llama-family model
    on a CPU in fp32 / bf16 / fp16, widths in whole 16-lane blocks, the step on, its library built (else said once)."""
    parameter = next(model.parameters(), None)
    if (os.environ.get(SWITCH) == "0" or parameter is None or parameter.device.type != "cpu"
            or parameter.dtype not in DTYPES or not llama_layout(model)
            or any(not p.is_contiguous() for p in model.parameters())):
        return False
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    widths = (model.config.hidden_size, attn.q_proj.out_features, attn.k_proj.out_features,
              mlp.gate_proj.out_features, model.get_output_embeddings().weight.shape[0])
    if any(w % LANES for w in widths) or attn.head_dim > 256 or attn.head_dim % 2:
        return False  # the kernel's products run over whole 16-lane blocks; its rotary buffer holds 256
    try:
        library()
    except KernelUnavailable as err:
        _compiler_missing(str(err))
        return False
    return True


class CpuStep:
    """The compiled step of one model, its weights read in place: `forward` over a static cache; `of` builds one."""

    def __init__(self, model: nn.Module, codes: bool = True, integer: bool = False) -> None:
        self.model = model
        self.codes = codes  # coded weights where the values allow (`encode`); False: every weight `pack`ed
        self.integer = integer  # coded weights multiplied as integers (`int_products.c`), the others as floats
        # the tensors whose version counters `forward` watches, listed once: walking the module tree costs 1.2 ms, a
        # twelfth of a step (a parameter replaced by another tensor changes `weights_key`: the static cache, and so
        # this step, is built again at the next call)
        self.parameters = tuple(model.parameters())
        self.dtype = self.parameters[0].dtype
        self.work = torch.empty(0)
        self._pack()

    def _pack(self) -> None:
        """The C struct over the model's norms and embedding, read in place, and copies of its products' weights in
        the kernel's layout (`pack`), made again when a parameter changes in place (its version counter moves)."""
        body, config, model = self.model.model, self.model.config, self.model
        first = body.layers[0].self_attn
        self.versions = self._versions()
        self.held = []  # what the struct points at stays allocated

        def keep(t: torch.Tensor) -> int:
            self.held.append(t)
            return t.data_ptr()

        def packed(linear: nn.Linear) -> Weight:
            data, bits = encode(linear.weight, self.integer) if self.codes else (pack(linear.weight.detach()), 0)
            return Weight(keep(data), bits, int(self.integer and bits in (4, 8)))

        bias = lambda linear: None if linear.bias is None else keep(linear.bias.detach())  # noqa: E731
        self.layers = (_Layer * len(body.layers))()
        for i, layer in enumerate(body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers[i] = _Layer(
                keep(layer.input_layernorm.weight.detach()), packed(attn.q_proj), packed(attn.k_proj),
                packed(attn.v_proj), bias(attn.q_proj), bias(attn.k_proj), bias(attn.v_proj), packed(attn.o_proj),
                bias(attn.o_proj), keep(layer.post_attention_layernorm.weight.detach()), packed(mlp.gate_proj),
                packed(mlp.up_proj), packed(mlp.down_proj), None, None)
        head = model.get_output_embeddings()
        self.struct = _Model(
            len(body.layers), config.hidden_size, first.q_proj.out_features // first.head_dim,
            first.k_proj.out_features // first.head_dim, first.head_dim, body.layers[0].mlp.gate_proj.out_features,
            head.weight.shape[0], body.embed_tokens.weight.shape[0], DTYPES[self.dtype], 0,
            float(body.layers[0].input_layernorm.variance_epsilon), float(first.scaling),
            keep(body.embed_tokens.weight.detach()), keep(body.norm.weight.detach()), packed(head), self.layers)

    def weights(self) -> list[tuple[Weight, nn.Linear]]:
        """Every product's kernel weight with its module, the head last."""
        names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
        return [(getattr(kernel, name), layer.get_submodule(path))
                for kernel, layer in zip(self.layers, self.model.model.layers) for name, path in names.items()
                ] + [(self.struct.head, self.model.get_output_embeddings())]

    @property
    def has_integer_products(self) -> bool:
        """Whether some product runs on integer codes (`integer` and the model holds coded weights)."""
        return any(w.integer for w, _ in self.weights())

    def multiply_adds(self) -> int:
        """A row's multiply-adds in the products."""
        return sum(linear.in_features * linear.out_features for _, linear in self.weights())

    def weight_bytes(self) -> int:
        """The bytes of the products' weights as the kernel reads them: what one step reads at least."""
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in self.held}
        return sum(sizes[w.data] for w, _ in self.weights())

    def _versions(self) -> list[int]:
        return [p._version for p in self.parameters]

    @classmethod
    def of(cls, model: nn.Module, integer: bool = False) -> CpuStep | None:
        """The step of `model` (`integer`: with integer products), or None where it does not apply (`applies`) or
        fails its probe (`agrees`)."""
        if not applies(model):
            return None
        step = cls(model, integer=integer)
        return step if step.agrees() else None

    @torch.no_grad()
    def agrees(self) -> bool:
        """The step's logits on a probe against the model's own (eager, dynamic cache): a look-alike that computes
        something else (scaled embeddings, another norm or rotary convention) differs by far more than sum order."""
        from transformers import DynamicCache

        from .facts import cache_keyword

        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.struct.tokens, (1, 6), generator=generator)
        expected = self.model(input_ids=ids, **{cache_keyword(self.model): DynamicCache(config=self.model.config)},
                              use_cache=True).logits[0].float()
        keys = [torch.zeros(1, self.struct.kv_heads, 8, self.struct.head_dim, dtype=self.dtype)
                for _ in range(self.struct.layers)]
        values = [torch.zeros_like(k) for k in keys]
        mask = torch.ones(6, 8, dtype=torch.bool).tril_()[None, None]
        logits, _ = self.forward(ids, mask, torch.arange(6)[None], torch.arange(6), 6, keys, values, False)
        spread = float(expected.max() - expected.min()) or 1.0
        return bool((logits[0].float() - expected).abs().max() <= PROBE_TOLERANCE * spread)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, write: torch.Tensor, keys: int,
                key_cache: list[torch.Tensor], value_cache: list[torch.Tensor], want_hidden: bool, last: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions (B, n); mask (B, 1, n, slots) bool over the cache's slots; the new keys and values go to
        slots `write` (n,) of every row of `key_cache[i]`, `value_cache[i]` (B, kv heads, slots, head dim); attention
        reads the first `keys` slots. -> logits (B, n, V) (`last`: (B, 1, V), the last token's, as a prefill needs)
        and, if asked, the final normed states (B, n, hidden), in the model's dtype."""
        if self._versions() != self.versions:  # weights edited in place (load_state_dict, an optimizer step)
            self._pack()
        batch, n = ids.shape
        rows, struct = batch * n, self.struct
        struct.slots = key_cache[0].shape[2]
        for layer, k, v in zip(self.layers, key_cache, value_cache):
            if k.dtype != self.dtype or not k.is_contiguous() or not v.is_contiguous() or k.shape[0] < batch:
                raise ValueError("the compiled step needs contiguous caches of its dtype with a row per batch row")
            layer.keys, layer.values = k.data_ptr(), v.data_ptr()
        cos, sin = self.model.model.rotary_emb(torch.empty(0, dtype=self.dtype), positions)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # the model's dtype values, as fp32
        size = library().cpu_step_work(struct, rows)
        if self.work.numel() < size:
            self.work = torch.empty(size)
        ids, write = (t.to(torch.long).contiguous() for t in (ids, write))
        logits = torch.empty(batch if last else rows, struct.vocab)
        states = torch.empty(rows, struct.hidden) if want_hidden else None
        view = mask[:, 0]
        failed = library().cpu_step_forward(
            struct, batch, n, ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), write.data_ptr(), view.data_ptr(),
            (ctypes.c_int64 * 3)(*view.stride()), keys, int(last), logits.data_ptr(),
            None if states is None else states.data_ptr(), self.work.data_ptr(), torch.get_num_threads())
        if failed == 3:
            raise IndexError(f"token ids must be in [0, {struct.tokens}), the target's embedding rows")
        if failed:
            raise RuntimeError(f"the compiled target step failed (code {failed})")
        logits = logits.view(batch, 1 if last else n, -1).to(self.dtype)
        return logits, None if states is None else states.view(batch, n, -1).to(self.dtype)
