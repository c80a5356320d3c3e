"""The compiled CPU step of a Mamba-2 drafter (`targets/drafter_step.c`): one C call per drafting level, for 1 to any
number of state rows, instead of ~100 small torch operations (the drafter's 'compiled' backend, `auto`'s choice on a
CPU where the kernel library builds).

A drafter only proposes, so the step need not have `MambaDrafter.step`'s bits: its products run on 8-bit codes of the
weights and activations (`int_products.c`, llama.cpp's Q8_0 numerics, within ~1 % of the float products) where the
widths allow, the rest follows the torch step's arithmetic in fp32 (`CompiledStep(integer=False)`: float products,
within float rounding of the torch step; the tests hold both there). Mamba-1 drafters, a drafter with biased
projections, other devices and MAMBA_DRAFT_CPU_STEP=0 keep the torch step.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import nn

from .targets import cpu_step


class _Layer(ctypes.Structure):
    _fields_ = [("norm", ctypes.c_void_p), ("in_proj", cpu_step.Weight), ("conv_w", ctypes.c_void_p),
                ("conv_b", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p), ("A", ctypes.c_void_p),
                ("D", ctypes.c_void_p), ("gate_norm", ctypes.c_void_p), ("out_proj", cpu_step.Weight)]


class _Drafter(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int) for name in (
        "layers", "d_model", "d_inner", "heads", "head_dim", "d_state", "groups", "conv_dim", "d_conv", "in_width",
        "target_hidden", "vocab", "dtype", "conv_dtype", "ssm_dtype", "residual_fp32")],
        *[(name, ctypes.c_float) for name in ("eps", "dt_low", "dt_high")],
        ("embed", ctypes.c_void_p), ("fuse", cpu_step.Weight), ("stand_in", ctypes.c_void_p),
        ("feature_norm", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", cpu_step.Weight),
        ("layer", ctypes.POINTER(_Layer))]


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cpu_step.library()
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.drafter_step.argtypes = [ctypes.POINTER(_Drafter), i32, pointer, i64, pointer, pointer, pointer,
                                 ctypes.POINTER(i64), pointer, pointer, pointer, i32]
    lib.drafter_step.restype = i32
    lib.drafter_step_work.argtypes = [ctypes.POINTER(_Drafter), i32]
    lib.drafter_step_work.restype = i64
    return lib


def applies(drafter) -> bool:
    """Whether the compiled step computes `drafter` here: a Mamba-2 drafter on a CPU in fp32 / bf16 with unbiased
    projections and a width of whole 16-lane blocks, the step on and its library built."""
    cfg = drafter.config
    mixers = [layer.mixer for layer in drafter.backbone.layers]
    return (cfg.arch == "mamba2" and cfg.d_model % cpu_step.LANES == 0 and drafter.device.type == "cpu"
            and drafter.dtype in (torch.float32, torch.bfloat16)
            and (drafter.state_dtype or drafter.dtype) in (torch.float32, torch.bfloat16)
            and all(m.in_proj.bias is None and m.out_proj.bias is None for m in mixers)
            and os.environ.get(cpu_step.SWITCH) != "0" and cpu_step.available())


class CompiledStep:
    """The C struct over one drafter's weights (copies of its products' weights in the kernel's layout, made again
    when a parameter changes in place) and the step's work space; called as the drafter's `step` body."""

    def __init__(self, integer: bool = True) -> None:
        self.integer = integer  # products on 8-bit codes (`cpu_step.quantized`), where the widths allow; else floats
        self.key: tuple | None = None
        self.work = torch.empty(0)

    def _pack(self, drafter) -> None:
        cfg, backbone = drafter.config, drafter.backbone
        self.held, dtype = [], drafter.dtype

        def keep(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            self.held.append(t)
            return t.data_ptr()

        def weight(w: torch.Tensor) -> tuple[cpu_step.Weight, int]:
            rows = -(-w.shape[0] // cpu_step.LANES) * cpu_step.LANES  # whole 16-lane blocks
            w = nn.functional.pad(w.detach(), (0, 0, 0, rows - w.shape[0]))
            if self.integer and w.shape[1] % cpu_step.GROUP == 0:
                return cpu_step.Weight(keep(cpu_step.quantized(w)), 8, 1), rows
            data, bits = cpu_step.encode(w)
            return cpu_step.Weight(keep(data), bits), rows

        layers = (_Layer * cfg.n_layer)()
        for i, block in enumerate(backbone.layers):
            mixer = block.mixer
            in_proj, width = weight(mixer.in_proj.weight)
            layers[i] = _Layer(keep(block.norm.weight), in_proj, keep(mixer.conv1d.weight.squeeze(1)),
                               keep(mixer.conv1d.bias), keep(mixer.dt_bias.float()),
                               keep(-torch.exp(mixer.A_log.float())), keep(mixer.D.float()), keep(mixer.norm.weight),
                               weight(mixer.out_proj.weight)[0])
        head = drafter.lm_head.weight[: cfg.real_vocab_size] if drafter.draft_head is None else drafter.draft_head
        head_weight, head_rows = weight(head)
        reads = cfg.target_hidden_size > 0
        low, high = cfg.dt_limit
        state_dtype = drafter.state_dtype or dtype
        self.layers = layers
        self.struct = _Drafter(
            cfg.n_layer, cfg.d_model, cfg.d_inner, cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.conv_dim,
            cfg.d_conv, width, cfg.target_hidden_size, head_rows, cpu_step.DTYPES[dtype], cpu_step.DTYPES[dtype],
            cpu_step.DTYPES[state_dtype], int(cfg.residual_in_fp32), cfg.norm_eps, low,
            high if math.isfinite(high) else math.inf, keep(backbone.embeddings.weight),
            weight(backbone.fuse.weight)[0] if reads else cpu_step.Weight(None, 0),
            keep(backbone.stand_in) if reads else None, keep(backbone.feature_norm.weight) if reads else None,
            keep(backbone.norm_f.weight), head_weight, layers)
        self.vocab = head.shape[0]

    def __call__(self, drafter, token_ids: torch.Tensor, state, features: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row (B,) into rows [0:B] of `state` -> (logits (B, V), final-norm states (B, d))."""
        head = drafter.draft_head  # the weights' addresses and in-place versions: a change repacks
        key = (tuple((p.data_ptr(), p._version) for p in drafter.parameters()), drafter.dtype,
               None if head is None else (head.data_ptr(), head._version))
        if key != self.key:
            self._pack(drafter)
            self.key = key
        rows, struct, lib = token_ids.shape[0], self.struct, _library()
        conv, ssm = state.conv, state.ssm
        if conv.stride()[2:] != (conv.shape[3], 1) or ssm.stride()[2:] != (ssm.shape[3] * ssm.shape[4], ssm.shape[4], 1):
            raise ValueError("the compiled drafter step needs each state row's buffers contiguous")
        strides = (ctypes.c_int64 * 4)(conv.stride(0), conv.stride(1), ssm.stride(0), ssm.stride(1))
        size = lib.drafter_step_work(struct, rows)
        if self.work.numel() < size:
            self.work = torch.empty(size)
        ids = token_ids.to(torch.long).contiguous()
        if features is not None:
            if features.shape != (rows, struct.target_hidden):
                raise ValueError(f"features must have shape {(rows, struct.target_hidden)}, got "
                                 f"{tuple(features.shape)}")
            features = features.float().contiguous()
        logits, normed = torch.empty(rows, struct.vocab), torch.empty(rows, struct.d_model)
        failed = lib.drafter_step(struct, rows, ids.data_ptr(), drafter.embedding_rows,
                                  None if features is None else features.data_ptr(), conv.data_ptr(), ssm.data_ptr(),
                                  strides, logits.data_ptr(), normed.data_ptr(),
                                  self.work.data_ptr(), torch.get_num_threads())
        if failed == 3:
            raise IndexError(f"token ids must be in [0, {drafter.embedding_rows})")
        if failed:
            raise RuntimeError(f"the compiled drafter step failed (code {failed})")
        return logits[:, : self.vocab].to(drafter.dtype), normed.to(drafter.dtype)

    def __getstate__(self) -> dict:  # a copy starts empty (copy.deepcopy goes through it too)
        return {"integer": self.integer, "key": None, "work": torch.empty(0)}
