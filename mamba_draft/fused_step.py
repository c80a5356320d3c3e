"""The drafter's one-token step as a few Triton kernels per layer (`MambaDrafter.set_backend("fused")`).

Why: on an H200 a captured step of the `kernels` backend (Mamba-130M shape: 24 layers, bf16) launches ~17 kernels a
layer, 415 a step, and takes 1.2 ms: launch-bound, the kernels themselves are tiny (a few rows times each weight).
Here every kernel does a layer's whole stage, so the step is a handful of launches a layer:

  per layer                                                                    Mamba-1  Mamba-2
  1 `_in_proj_kernel`: RMSNorm of the residual stream (of the embedding rows       1        1
    at the first layer, which starts the stream), in_proj (+ bias), and on the
    conv channels of its output the conv step (state rolled in place, + bias)
    and SiLU
  2 `_linear_kernel` as x_proj: [dt_low | B | C] (Mamba-1)                          1        -
  3 `_mamba1_ssm_kernel` / `_mamba2_ssm_kernel`: dt (dt_proj for Mamba-1, dt        1        1
    bias, softplus, Mamba-2's dt_limit), state <- exp(dt A) state + dt x B in
    place, y = (state C + D x) * silu(z)
  4 `_linear_kernel` as out_proj: (Mamba-2: RMSNorm of y per group first, its       1        1
    gated norm with norm_before_gate=False) and the residual stream += out
  per step: the layers, `_rms_norm_kernel` (the final norm, in the residual stream's dtype as the torch step's) and
  the head in torch (`MambaDrafter._head`: a matmul, after a cast of an fp32 norm to bf16 weights' dtype), counted by
  `FusedStep.kernels_per_step`: 4 L + 3 (Mamba-1) and 3 L + 3 (Mamba-2) in bf16, 99 and 75 for 24 layers.
A drafter that reads the target adds `MambaDrafter.embed`'s torch ops (its fusion); the first layer reads their output.

Each stage needs whole rows of the one before (a norm, a product over every input), so stages meet at a launch;
within a stage each program owns its outputs, and reads nothing another program of the launch writes. The norms are
recomputed by every program of a product (d_model or d_inner values a row: cheap beside the product). Products are
sums of broadcast products over blocks of up to 4 rows (tl.dot needs 16), in fp32 from weights in their dtype.
Activations between launches are fp32 (`Scratch`); the states keep their dtypes (conv: the weights', SSM: the
drafter's `state_dtype`), computed in fp32 and rounded once when stored.

Parameters are read where they are, so they must be contiguous (as nn.Linear / nn.Conv1d make them). Scratch is
allocated once per power-of-two row count and kept (a captured CUDA graph holds its addresses): a step allocates
only what it returns, and has fixed shapes and no host sync, so `graphs.StepRunner` captures it as it does the others.

Off CUDA the kernels run only in Triton's interpreter (TRITON_INTERPRET=1), which is how tests/test_fused_step.py
checks them against the torch step on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LAUNCHES_PER_LAYER = {"mamba1": 4, "mamba2": 3}
# Launches after the layers: the final norm, and the head's matmul (`MambaDrafter._head`, in torch).
LAUNCHES_AFTER_LAYERS = 2
# Tiles of the products: rows, outputs and inputs per step of the loop over inputs.
BLOCK_ROWS, BLOCK_OUT, BLOCK_IN = 4, 32, 64
# SSM tiles: Mamba-1 channels per program, Mamba-2 head-dimension entries per program.
BLOCK_CHANNELS, BLOCK_HEADDIM = 64, 16


@triton.jit
def _softplus(x):
    # torch's softplus (identity above 20) in mamba-ssm's form
    return tl.where(x <= 20.0, tl.log(tl.exp(x) + 1.0), x)


@triton.jit
def _normed_matvec(x_rows, row_mask, norm_weight_ptr, weight_ptr, in_features, offs_out, out_mask, start, stop, eps,
                   NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """weight[out, start:stop] @ x[row, start:stop] for a block of rows (x_rows: pointers to each row's first input,
    (BLOCK_M, 1)) and a block of outputs, in fp32; with NORM, x is RMS-normalised over [start, stop) and scaled by the
    norm's weight first. The weight is (outputs, in_features), contiguous."""
    offs_k = tl.arange(0, BLOCK_K)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if NORM:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in range(start, stop, BLOCK_K):
            cols = k + offs_k
            x = tl.load(x_rows + cols[None, :], mask=row_mask[:, None] & (cols < stop)[None, :], other=0.0)
            squares += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        rstd = 1.0 / tl.sqrt(squares / (stop - start) + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(start, stop, BLOCK_K):
        cols = k + offs_k
        col_mask = cols < stop
        x = tl.load(x_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if NORM:
            x *= tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w = tl.load(weight_ptr + offs_out[:, None] * in_features + cols[None, :],
                    mask=out_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc * rstd[:, None]


@triton.jit
def _in_proj_kernel(x_ptr, ids_ptr, stride_x, residual_ptr, stride_residual, norm_weight_ptr, weight_ptr, bias_ptr,
                    out_ptr, stride_out, conv_state_ptr, stride_state_row, stride_state_channel, stride_state_tap,
                    conv_weight_ptr, conv_bias_ptr, rows, d_model, out_features, conv_start, conv_channels, eps,
                    GATHER: tl.constexpr, START_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_CONV_BIAS: tl.constexpr, D_CONV: tl.constexpr, BLOCK_TAPS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A layer's first stage: out = in_proj(RMSNorm(x)) (+ bias), then on the conv's channels
    [conv_start, conv_start + conv_channels) of out the causal conv step and SiLU, the conv state (rows, channels,
    D_CONV) rolled one tap in place. x: the residual stream, or at the first layer the embedding rows `ids` picks
    (GATHER) or the drafter's `embed` output, which START_RESIDUAL copies into the residual stream (the programs of
    the first output block do: no program of this launch reads the stream)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, out_mask = offs_m < rows, offs_n < out_features
    source_rows = tl.load(ids_ptr + offs_m, mask=row_mask, other=0) if GATHER else offs_m
    x_rows = x_ptr + source_rows[:, None] * stride_x
    if START_RESIDUAL:
        for k in range(0, d_model, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            mask = (row_mask[:, None] & (cols < d_model)[None, :]) & (pid_n == 0)
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
            tl.store(residual_ptr + offs_m[:, None] * stride_residual + cols[None, :],
                     x.to(residual_ptr.dtype.element_ty), mask=mask)
    out = _normed_matvec(x_rows, row_mask, norm_weight_ptr, weight_ptr, d_model, offs_n, out_mask, 0, d_model, eps,
                         True, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=out_mask, other=0.0).to(tl.float32)[None, :]

    # The conv step on this block's conv channels: the state's taps 1.. shifted to 0.., this step's value appended.
    channels = offs_n - conv_start
    is_conv = out_mask & (channels >= 0) & (channels < conv_channels)
    taps = tl.arange(0, BLOCK_TAPS)
    state_mask = (row_mask[:, None] & is_conv[None, :])[:, :, None] & (taps < D_CONV)[None, None, :]
    tap_ptrs = (conv_state_ptr + offs_m[:, None, None] * stride_state_row
                + channels[None, :, None] * stride_state_channel + taps[None, None, :] * stride_state_tap)
    window = tl.load(tap_ptrs + stride_state_tap, mask=state_mask & (taps < D_CONV - 1)[None, None, :], other=0.0)
    window = tl.where((taps == D_CONV - 1)[None, None, :], out[:, :, None], window.to(tl.float32))
    tl.debug_barrier()  # every old tap is read before any is overwritten
    tl.store(tap_ptrs, window.to(conv_state_ptr.dtype.element_ty), mask=state_mask)
    conv_weight = tl.load(conv_weight_ptr + channels[:, None] * D_CONV + taps[None, :],
                          mask=is_conv[:, None] & (taps < D_CONV)[None, :], other=0.0).to(tl.float32)
    conv = tl.sum(window * conv_weight[None, :, :], axis=2)
    if HAS_CONV_BIAS:
        conv += tl.load(conv_bias_ptr + channels, mask=is_conv, other=0.0).to(tl.float32)[None, :]
    out = tl.where(is_conv[None, :], conv * tl.sigmoid(conv), out)
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], out,
             mask=row_mask[:, None] & out_mask[None, :])


@triton.jit
def _linear_kernel(x_ptr, stride_x, norm_weight_ptr, weight_ptr, bias_ptr, out_ptr, stride_out, rows, in_features,
                   out_features, group_size, eps, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out (+)= linear(x) (+ bias) for rows of x (rows, in_features); with NORM, x RMS-normalised per group of
    group_size inputs first (Mamba-2's gated norm, y already gated); ACCUMULATE adds into out (the residual stream)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, out_mask = offs_m < rows, offs_n < out_features
    x_rows = x_ptr + offs_m[:, None] * stride_x
    out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, in_features, group_size):
        out += _normed_matvec(x_rows, row_mask, norm_weight_ptr, weight_ptr, in_features, offs_n, out_mask, start,
                              start + group_size, eps, NORM, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
    mask = row_mask[:, None] & out_mask[None, :]
    if ACCUMULATE:
        out += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mamba1_ssm_kernel(proj_ptr, stride_proj, dbc_ptr, stride_dbc, dt_weight_ptr, dt_bias_ptr, A_log_ptr, D_ptr,
                       state_ptr, stride_state_row, stride_state_channel, stride_state_n, y_ptr, stride_y,
                       d_inner, dt_rank, d_state,
                       BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mamba-1's stage 3 for a row's block of channels. proj: [x (conv'd) | z]; dbc: [dt_low | B | C]."""
    row = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_r, offs_n = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_N)
    d_mask, r_mask, n_mask = offs_d < d_inner, offs_r < dt_rank, offs_n < d_state
    dn_mask = d_mask[:, None] & n_mask[None, :]
    dbc = dbc_ptr + row * stride_dbc
    dt_low = tl.load(dbc + offs_r, mask=r_mask, other=0.0)
    dt_weight = tl.load(dt_weight_ptr + offs_d[:, None] * dt_rank + offs_r[None, :],
                        mask=d_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dt = _softplus(tl.sum(dt_weight * dt_low[None, :], axis=1) + dt_bias)
    B = tl.load(dbc + dt_rank + offs_n, mask=n_mask, other=0.0)
    C = tl.load(dbc + dt_rank + d_state + offs_n, mask=n_mask, other=0.0)
    x = tl.load(proj_ptr + row * stride_proj + offs_d, mask=d_mask, other=0.0)
    z = tl.load(proj_ptr + row * stride_proj + d_inner + offs_d, mask=d_mask, other=0.0)
    A_log = tl.load(A_log_ptr + offs_d[:, None] * d_state + offs_n[None, :], mask=dn_mask, other=0.0)
    A = -tl.exp(A_log.to(tl.float32))
    state_ptrs = (state_ptr + row * stride_state_row + offs_d[:, None] * stride_state_channel
                  + offs_n[None, :] * stride_state_n)
    state = tl.load(state_ptrs, mask=dn_mask, other=0.0).to(tl.float32)
    state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=dn_mask)
    y = tl.sum(state * C[None, :], axis=1) + tl.load(D_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32) * x
    tl.store(y_ptr + row * stride_y + offs_d, y * z * tl.sigmoid(z), mask=d_mask)


@triton.jit
def _mamba2_ssm_kernel(proj_ptr, stride_proj, dt_bias_ptr, A_log_ptr, D_ptr, state_ptr, stride_state_row,
                       stride_state_head, stride_state_p, stride_state_n, y_ptr, stride_y, d_inner, ngroups,
                       heads_per_group, headdim, d_state, dt_min, dt_max,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mamba-2's stage 3 for a row's head (a block of its headdim), B and C those of the head's group.
    proj: [z | x B C (conv'd) | dt]."""
    row, head = tl.program_id(0), tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = offs_p < headdim, offs_n < d_state
    pn_mask = p_mask[:, None] & n_mask[None, :]
    proj = proj_ptr + row * stride_proj
    group_B = proj + 2 * d_inner + (head // heads_per_group) * d_state  # its group's C: ngroups * d_state further
    dt_start = 2 * d_inner + 2 * ngroups * d_state
    dt = _softplus(tl.load(proj + dt_start + head) + tl.load(dt_bias_ptr + head).to(tl.float32))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(-dt * tl.exp(tl.load(A_log_ptr + head).to(tl.float32)))
    B = tl.load(group_B + offs_n, mask=n_mask, other=0.0)
    C = tl.load(group_B + ngroups * d_state + offs_n, mask=n_mask, other=0.0)
    x = tl.load(proj + d_inner + head * headdim + offs_p, mask=p_mask, other=0.0)
    z = tl.load(proj + head * headdim + offs_p, mask=p_mask, other=0.0)
    state_ptrs = (state_ptr + row * stride_state_row + head * stride_state_head + offs_p[:, None] * stride_state_p
                  + offs_n[None, :] * stride_state_n)
    state = tl.load(state_ptrs, mask=pn_mask, other=0.0).to(tl.float32)
    state = state * decay + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=pn_mask)
    y = tl.sum(state * C[None, :], axis=1) + tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + row * stride_y + head * headdim + offs_p, y * z * tl.sigmoid(z), mask=p_mask)


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, weight_ptr, out_ptr, stride_out, d_model, eps, BLOCK: tl.constexpr):
    """out = RMSNorm(x) for a row: the final norm of the residual stream."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d_model
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d_model + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass
class Scratch:
    """What one step's launches hand each other, for up to as many rows as its buffers have."""

    residual: torch.Tensor  # (rows, d_model), fp32 with residual_in_fp32, else the weights' dtype
    proj: torch.Tensor  # (rows, in_proj outputs) fp32: in_proj's output, conv'd and SiLU'd on the conv channels
    dbc: torch.Tensor | None  # (rows, dt_rank + 2 d_state) fp32: Mamba-1's x_proj output [dt_low | B | C]
    y: torch.Tensor  # (rows, d_inner) fp32: the SSM's output gated by silu(z)


def check_fused_device(device: torch.device) -> None:
    """RuntimeError unless the kernels can run on `device`: CUDA, or a CPU under Triton's interpreter."""
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"backend='fused' needs the drafter on a CUDA device (it is on {device}; on a CPU only "
                           "Triton's interpreter runs it, with TRITON_INTERPRET=1)")


def _tiles(rows: int, out_features: int, in_features: int) -> tuple[tuple[int, int], dict]:
    """The grid and the block sizes of a product's launch."""
    blocks = dict(BLOCK_M=min(triton.next_power_of_2(rows), BLOCK_ROWS),
                  BLOCK_N=min(triton.next_power_of_2(out_features), BLOCK_OUT),
                  BLOCK_K=min(triton.next_power_of_2(in_features), BLOCK_IN))
    return (triton.cdiv(rows, blocks["BLOCK_M"]), triton.cdiv(out_features, blocks["BLOCK_N"])), blocks


class FusedStep:
    """A Mamba drafter's step as the launches of the module's plan, and the scratch they pass between them (one per
    drafter: `MambaDrafter.fused`), kept while the drafter's device and dtype stay."""

    def __init__(self) -> None:
        self.layout: tuple | None = None  # (device, dtype) the scratch is for
        self.scratch: dict[int, Scratch] = {}  # row capacity -> buffers

    @staticmethod
    def kernels_per_step(config, dtype: torch.dtype) -> int:
        """Kernels a step launches (the module's plan) for a drafter in `dtype` that reads token ids only."""
        head_cast = config.residual_in_fp32 and dtype != torch.float32
        return config.n_layer * LAUNCHES_PER_LAYER[config.arch] + LAUNCHES_AFTER_LAYERS + head_cast

    def __call__(self, drafter, token_ids: torch.Tensor, state, features: torch.Tensor | None = None) -> torch.Tensor:
        """Step rows [0:B] of `state` (in place) with token_ids (B,) (and `features`, `MambaDrafter.embed`); returns
        the final norm's output (B, d_model) in the residual stream's dtype, as the torch step does."""
        cfg, batch = drafter.config, token_ids.shape[0]
        scratch = self._scratch(drafter, batch)
        if drafter.reads_target:  # the fusion with the target's state in torch; the first layer reads its output
            inputs, ids = drafter.embed(token_ids, features), None
        else:  # the first layer gathers the embedding rows itself
            inputs, ids = drafter.backbone.embeddings.weight, token_ids
        for i, layer in enumerate(drafter.backbone.layers):
            _in_proj(layer, inputs, ids, scratch, state.conv[i], batch, start_residual=i == 0)
            inputs, ids, mixer = scratch.residual, None, layer.mixer
            if cfg.arch == "mamba1":
                _linear(scratch.proj, mixer.x_proj, scratch.dbc, batch, accumulate=False)
                _mamba1_ssm(mixer, scratch, state.ssm[i], batch)
                _linear(scratch.y, mixer.out_proj, scratch.residual, batch, accumulate=True)
            else:
                _mamba2_ssm(mixer, scratch, state.ssm[i], batch)
                _linear(scratch.y, mixer.out_proj, scratch.residual, batch, accumulate=True, norm=mixer.norm,
                        group_size=cfg.d_inner // cfg.ngroups)
        norm = drafter.backbone.norm_f
        normed = torch.empty(batch, cfg.d_model, dtype=scratch.residual.dtype, device=drafter.device)
        _rms_norm_kernel[(batch,)](scratch.residual, scratch.residual.stride(0), norm.weight, normed,
                                   normed.stride(0), cfg.d_model, norm.eps,
                                   BLOCK=triton.next_power_of_2(cfg.d_model))
        return normed

    def _scratch(self, drafter, batch: int) -> Scratch:
        """The buffers for `batch` rows: those of the next power of two, made at its first step."""
        layout = (drafter.device, drafter.dtype)
        if layout != self.layout:  # new weights: graphs captured on the old scratch are invalid anyway
            check_fused_device(drafter.device)
            self.layout, self.scratch = layout, {}
        rows = triton.next_power_of_2(batch)
        if rows not in self.scratch:
            cfg = drafter.config
            zeros = lambda width, dtype=torch.float32: torch.zeros(rows, width, dtype=dtype, device=drafter.device)
            self.scratch[rows] = Scratch(
                residual=zeros(cfg.d_model, torch.float32 if cfg.residual_in_fp32 else drafter.dtype),
                proj=zeros(drafter.backbone.layers[0].mixer.in_proj.out_features),
                dbc=zeros(cfg.dt_rank + 2 * cfg.d_state) if cfg.arch == "mamba1" else None,
                y=zeros(cfg.d_inner))
        return self.scratch[rows]


def _in_proj(layer, inputs, ids, scratch: Scratch, conv_state, batch: int, start_residual: bool) -> None:
    """Stage 1 of `layer` (`_in_proj_kernel`) on rows [0:batch] of `inputs` (`ids` picks them: the embedding)."""
    mixer, cfg = layer.mixer, layer.mixer.cfg
    linear, conv = mixer.in_proj, mixer.conv1d
    grid, blocks = _tiles(batch, linear.out_features, cfg.d_model)
    _in_proj_kernel[grid](
        inputs, ids, inputs.stride(0), scratch.residual, scratch.residual.stride(0), layer.norm.weight,
        linear.weight, linear.bias, scratch.proj, scratch.proj.stride(0), conv_state, *conv_state.stride(),
        conv.weight, conv.bias, batch, cfg.d_model, linear.out_features,
        0 if cfg.arch == "mamba1" else cfg.d_inner, cfg.conv_dim, layer.norm.eps,
        GATHER=ids is not None, START_RESIDUAL=start_residual, HAS_BIAS=linear.bias is not None,
        HAS_CONV_BIAS=conv.bias is not None, D_CONV=cfg.d_conv, BLOCK_TAPS=triton.next_power_of_2(cfg.d_conv),
        **blocks)


def _linear(x: torch.Tensor, linear, out: torch.Tensor, batch: int, *, accumulate: bool, norm=None,
            group_size: int | None = None) -> None:
    """out[:batch] (+)= linear(x[:batch, :in_features]) (`_linear_kernel`), x first normalised per group by `norm`."""
    grid, blocks = _tiles(batch, linear.out_features, linear.in_features)
    _linear_kernel[grid](
        x, x.stride(0), None if norm is None else norm.weight, linear.weight, linear.bias, out, out.stride(0), batch,
        linear.in_features, linear.out_features, group_size or linear.in_features,
        0.0 if norm is None else norm.eps, NORM=norm is not None, HAS_BIAS=linear.bias is not None,
        ACCUMULATE=accumulate, **blocks)


def _mamba1_ssm(mixer, scratch: Scratch, ssm_state, batch: int) -> None:
    cfg = mixer.cfg
    block = min(triton.next_power_of_2(cfg.d_inner), BLOCK_CHANNELS)
    _mamba1_ssm_kernel[(batch, triton.cdiv(cfg.d_inner, block))](
        scratch.proj, scratch.proj.stride(0), scratch.dbc, scratch.dbc.stride(0), mixer.dt_proj.weight,
        mixer.dt_proj.bias, mixer.A_log, mixer.D, ssm_state, *ssm_state.stride(), scratch.y, scratch.y.stride(0),
        cfg.d_inner, cfg.dt_rank, cfg.d_state, BLOCK_D=block, BLOCK_R=triton.next_power_of_2(cfg.dt_rank),
        BLOCK_N=triton.next_power_of_2(cfg.d_state))


def _mamba2_ssm(mixer, scratch: Scratch, ssm_state, batch: int) -> None:
    cfg = mixer.cfg
    block = min(triton.next_power_of_2(cfg.headdim), BLOCK_HEADDIM)
    _mamba2_ssm_kernel[(batch, cfg.nheads, triton.cdiv(cfg.headdim, block))](
        scratch.proj, scratch.proj.stride(0), mixer.dt_bias, mixer.A_log, mixer.D, ssm_state, *ssm_state.stride(),
        scratch.y, scratch.y.stride(0), cfg.d_inner, cfg.ngroups, cfg.nheads // cfg.ngroups, cfg.headdim,
        cfg.d_state, *cfg.dt_limit, BLOCK_P=block, BLOCK_N=triton.next_power_of_2(cfg.d_state))
