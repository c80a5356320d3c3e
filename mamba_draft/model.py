"""The Mamba drafter: Mamba-1 / Mamba-2 language model with an explicit, preallocated recurrent state.

Parameter names match `transformers.MambaForCausalLM` / `Mamba2ForCausalLM`, so HF checkpoints load as they are.
The torch path is the reference; on CUDA the single-token step can use the optional kernels (`kernels.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import DRAFT_IDS, check_draft_ids, check_tensors, load_checkpoint, save_checkpoint
from .config import MambaConfig
from .ids import SharedCalls, check_batch
from .kernels import Kernels, load_kernels  # noqa: F401  (Kernels: tests stand in for the kernels)
from .packed_linear import PackCache, pack_linears
from . import cpu_drafter
from .row_linear import RowKernelCache, use_row_kernel

BACKENDS = ("auto", "torch", "kernels", "fused", "compiled")
# Prefill runs the recurrence in slices of this many positions, bounding the (B, L, d_inner, d_state) temporaries.
SCAN_SLICE = 128


@dataclass
class DrafterState:
    """The Mamba drafter's state (a `mamba_draft.drafter.DraftState`): per-layer conv and SSM buffers, preallocated
    for a maximum batch and only written in place, so a CUDA graph captured on a view of them stays valid."""

    conv: torch.Tensor  # (n_layer, max_batch, conv_dim, d_conv)
    ssm: torch.Tensor  # (n_layer, max_batch, *ssm_state_shape)

    @property
    def max_batch(self) -> int:
        return self.conv.shape[1]

    @property
    def device(self) -> torch.device:
        return self.conv.device

    @property
    def nbytes(self) -> int:
        """Memory of these rows' buffers: fixed, whatever the context."""
        return self.conv.nbytes + self.ssm.nbytes

    def rows(self, start: int, stop: int) -> "DrafterState":
        if not 0 <= start < stop <= self.max_batch:
            raise IndexError(f"rows [{start}:{stop}] out of range for a state of {self.max_batch} rows")
        return DrafterState(self.conv[:, start:stop], self.ssm[:, start:stop])

    def gather_(self, dst_start: int, src_rows: torch.Tensor) -> "DrafterState":
        n = src_rows.shape[0]
        if dst_start < 0 or dst_start + n > self.max_batch:
            raise IndexError(f"gather of {n} rows at {dst_start} overflows a state of {self.max_batch} rows")
        # index_select materialises the sources before the copy, so overlapping rows are read before written.
        for buffer in (self.conv, self.ssm):
            buffer[:, dst_start:dst_start + n].copy_(buffer.index_select(1, src_rows))
        return self

    def reset_(self) -> "DrafterState":
        self.conv.zero_()
        self.ssm.zero_()
        return self

    def clone(self) -> "DrafterState":
        return DrafterState(self.conv.clone(), self.ssm.clone())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if gate is not None:  # Mamba-2's gated norm: normalise y * silu(z) per group
            x = x * F.silu(gate.float())
        shape = x.shape
        if group_size is not None:
            x = x.view(*shape[:-1], shape[-1] // group_size, group_size)
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * x.view(shape).to(dtype)


def _conv_sequence(x: torch.Tensor, conv_state: torch.Tensor | None, conv: nn.Conv1d) -> torch.Tensor:
    """Causal depthwise conv (and silu) over x (B, L, C) continuing from conv_state (B, C, K), updated in place;
    None: from zeros, keeping no state (the training forward: autograd needs nothing written in place)."""
    x = x.transpose(1, 2)
    length, width = x.shape[-1], conv.weight.shape[-1]
    if conv_state is None:
        full = F.pad(x, (width, 0))
    else:
        full = torch.cat([conv_state.to(x.dtype), x], dim=-1)
        conv_state.copy_(full[..., -width:])
    out = F.conv1d(full, conv.weight, conv.bias, groups=x.shape[1])
    return F.silu(out[..., -length:]).transpose(1, 2)


def _conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """One position of the causal conv: x (B, C); shifts conv_state (B, C, K) left and appends x."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = (conv_state * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out)


def _ssm_update(ssm_state: torch.Tensor, decay: torch.Tensor, dx: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """ssm_state <- ssm_state * decay + dx * B (broadcast), in place; returns the new state in fp32. An fp32 state
    is updated where it lies (no temporaries); a low-precision one is computed in fp32 and rounded once."""
    if ssm_state.dtype == torch.float32:
        return ssm_state.mul_(decay).addcmul_(dx, B)
    state = torch.addcmul(ssm_state.float() * decay, dx, B)
    ssm_state.copy_(state)
    return state


def _ssd_scan(x, dt, A, B, C, state, chunk: int = SCAN_SLICE):
    """Mamba-2 recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t in chunks (the SSD form: inside
    a chunk the pairwise decays exp(cum_t - cum_s), s <= t, make it batched matmuls), continuing from `state`.
    x (b, L, H, P), dt (b, L, H), A (H,), B/C (b, L, H, N), state (b, H, P, N) -> y (b, L, H, P), final state."""
    ys = []
    for start in range(0, x.shape[1], chunk):
        s = slice(start, start + chunk)
        xc, dtc, Bc, Cc = x[:, s], dt[:, s], B[:, s], C[:, s]
        cum = torch.cumsum(dtc * A, dim=1)  # (b, l, H) inclusive log-decay
        length = cum.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * torch.exp(diff)  # (b, t, s, H)
        y = torch.einsum("btsh,bshp->bthp", scores, xc * dtc[..., None])
        y = y + torch.einsum("bhpn,bthn->bthp", state, Cc) * torch.exp(cum)[..., None]
        decay_to_end = torch.exp(cum[:, -1:] - cum)  # (b, l, H)
        state = state * torch.exp(cum[:, -1])[..., None, None] + torch.einsum(
            "bsh,bshp,bshn->bhpn", decay_to_end * dtc, xc, Bc)
        ys.append(y)
    return torch.cat(ys, dim=1), state


class MambaMixer(nn.Module):
    """Mamba-1 selective SSM block (HF `MambaMixer` parameter names)."""

    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.cfg = cfg
        d_inner, n = cfg.d_inner, cfg.d_state
        self.in_proj = nn.Linear(cfg.d_model, 2 * d_inner, bias=cfg.bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, cfg.d_conv, groups=d_inner, padding=cfg.d_conv - 1,
                                bias=cfg.conv_bias)
        self.x_proj = nn.Linear(d_inner, cfg.dt_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(cfg.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, cfg.d_model, bias=cfg.bias)

    def _dt_B_C(self, x: torch.Tensor):
        dt, B, C = self.x_proj(x).split([self.cfg.dt_rank, self.cfg.d_state, self.cfg.d_state], dim=-1)
        return F.linear(dt, self.dt_proj.weight), B, C  # dt_proj bias is added inside the softplus

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> torch.Tensor:
        """h (B, L, d_model) continuing from the given state rows, updated in place (None: zero state, not kept)."""
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = _conv_sequence(x, conv_state, self.conv1d)  # (B, L, d_inner)
        dt, B, C = self._dt_B_C(x)
        dt = F.softplus((dt + self.dt_proj.bias).float())
        A = -torch.exp(self.A_log.float())
        state = x.new_zeros(x.shape[0], *self.A_log.shape, dtype=torch.float32) if ssm_state is None \
            else ssm_state.float()
        ys = []
        for start in range(0, x.shape[1], SCAN_SLICE):
            s = slice(start, start + SCAN_SLICE)
            dA = torch.exp(dt[:, s, :, None] * A)  # (B, l, d_inner, N)
            dBx = (dt[:, s] * x[:, s].float())[..., None] * B[:, s, None, :].float()
            # unbind, not dA[:, t]: autograd then stacks the slices' gradients once instead of scattering each
            # into a zero tensor of the whole slice (that made the backward O(L^2), as transformers' reference is).
            for dA_t, dBx_t, C_t in zip(dA.unbind(1), dBx.unbind(1), C[:, s].float().unbind(1)):
                state = state * dA_t + dBx_t
                ys.append(torch.matmul(state, C_t[..., None])[..., 0])
        if ssm_state is not None:
            ssm_state.copy_(state)
        return self._out(torch.stack(ys, dim=1), x.float(), z, h.dtype)

    def _out(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.out_proj(((y + x * self.D.float()) * F.silu(z.float())).to(dtype))

    def step(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, kernels) -> torch.Tensor:
        """h (B, d_model) for one position; updates the state rows in place."""
        x, z = self.in_proj(h).chunk(2, dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = -torch.exp(self.A_log.float())
        if kernels is not None:  # D and the dt bias as they are: the kernel loads every operand as fp32
            x = kernels.causal_conv1d_update(x, conv_state, weight, self.conv1d.bias, "silu")
            dt, B, C = self._dt_B_C(x)
            y = kernels.selective_state_update(ssm_state, x, dt, A, B, C, self.D, z=z, dt_bias=self.dt_proj.bias,
                                               dt_softplus=True)
            return self.out_proj(y)
        x = _conv_step(x, conv_state, weight, self.conv1d.bias)
        dt, B, C = self._dt_B_C(x)
        dt = F.softplus((dt + self.dt_proj.bias).float())
        x = x.float()
        state = _ssm_update(ssm_state, torch.exp(dt[..., None] * A), (dt * x)[..., None], B[:, None, :].float())
        return self._out((state * C.float()[:, None, :]).sum(-1), x, z, h.dtype)  # cheaper than a matmul on CPU


class Mamba2Mixer(nn.Module):
    """Mamba-2 (SSD) block with a gated RMSNorm (HF `Mamba2Mixer` parameter names, norm_before_gate=False)."""

    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.nheads
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_inner + cfg.conv_dim + h, bias=cfg.bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim,
                                padding=cfg.d_conv - 1, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = RMSNorm(cfg.d_inner, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.bias)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.cfg.dt_limit
        return F.softplus((dt + self.dt_bias).float()).clamp(min=lo, max=hi)

    def _out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = self.norm(y.to(dtype), gate=z, group_size=self.cfg.d_inner // self.cfg.ngroups)
        return self.out_proj(y.to(dtype))

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        z, xbc, dt = self.in_proj(h).split([cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)
        gn = cfg.ngroups * cfg.d_state
        x, B, C = _conv_sequence(xbc, conv_state, self.conv1d).split([cfg.d_inner, gn, gn], dim=-1)
        lead, rep = x.shape[:-1], cfg.nheads // cfg.ngroups
        x = x.reshape(*lead, cfg.nheads, cfg.headdim)  # (B, L, H, P)
        B = B.reshape(*lead, cfg.ngroups, cfg.d_state).repeat_interleave(rep, dim=-2)  # (B, L, H, N)
        C = C.reshape(*lead, cfg.ngroups, cfg.d_state).repeat_interleave(rep, dim=-2)
        dt = self._dt(dt)  # (B, L, H)
        A = -torch.exp(self.A_log.float())
        start = x.new_zeros(x.shape[0], *cfg.ssm_state_shape, dtype=torch.float32) if ssm_state is None \
            else ssm_state.float()
        y, final = _ssd_scan(x.float(), dt, A, B.float(), C.float(), start)
        if ssm_state is not None:
            ssm_state.copy_(final)
        y = y + x.float() * self.D.float()[:, None]
        return self._out(y.flatten(-2), z, h.dtype)

    def step(self, h: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, kernels) -> torch.Tensor:
        cfg = self.cfg
        z, xbc, dt = self.in_proj(h).split([cfg.d_inner, cfg.conv_dim, cfg.nheads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        A = -torch.exp(self.A_log.float())
        G, N, P = cfg.ngroups, cfg.d_state, cfg.headdim
        sizes = [cfg.d_inner, G * N, G * N]  # x, B, C
        if kernels is not None:
            xbc = kernels.causal_conv1d_update(xbc, conv_state, weight, self.conv1d.bias, "silu")
            x, B, C = xbc.split(sizes, dim=-1)
            dt_bias, softplus = self.dt_bias, True  # the kernel adds the bias and applies softplus (>= 0)
            if cfg.dt_limit != (0.0, math.inf):
                # The kernel has no dt_limit: bias, softplus and clamp here, and a zero bias for the kernel (it reads
                # dt_bias's strides, so None would fail).
                dt_bias, softplus = dt.new_zeros(cfg.nheads), False
                dt = self._dt(dt)
            # Broadcast per-head scalars over headdim with zero strides: the kernel detects this (TIE_HDIM).
            y = kernels.selective_state_update(
                ssm_state, x.reshape(-1, cfg.nheads, P), dt[..., None].expand(-1, -1, P),
                A[:, None, None].expand(-1, P, N), B.reshape(-1, G, N), C.reshape(-1, G, N),
                self.D[:, None].expand(-1, P), z=None, dt_bias=dt_bias[:, None].expand(-1, P),
                dt_softplus=softplus)
            return self._out(y.flatten(-2), z, h.dtype)
        xbc = _conv_step(xbc, conv_state, weight, self.conv1d.bias)
        # heads h = g * R + r share group g's B and C: broadcast them (no repeat_interleave copies)
        rows = xbc.shape[0]
        x, B, C = xbc.float().split(sizes, dim=-1)
        x = x.view(rows, G, -1, P)  # (b, G, R, P)
        dt = self._dt(dt)  # (b, H)
        decay = torch.exp(dt * A).view(rows, G, -1, 1, 1)
        dx = (dt.view(rows, G, -1, 1) * x)[..., None]  # (b, G, R, P, 1)
        state = _ssm_update(ssm_state.view(rows, G, -1, P, N), decay, dx, B.view(rows, G, 1, 1, N))
        # y = state @ C as a product and a sum over N: cheaper than a batched matmul of (P, N) @ (N, 1) on CPU
        y = (state * C.view(rows, G, 1, 1, N)).sum(-1) + x * self.D.float().view(G, -1, 1)
        return self._out(y.flatten(1), z, h.dtype)


class Block(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MambaMixer(cfg) if cfg.arch == "mamba1" else Mamba2Mixer(cfg)

    def forward(self, h, conv_state, ssm_state, one_position: bool = False):
        """A block of positions h (B, L, d), or with `one_position` the torch step on h (B, d)."""
        x = self.norm(h.to(self.norm.weight.dtype))
        mix = self.mixer.step(x, conv_state, ssm_state, None) if one_position else self.mixer(x, conv_state, ssm_state)
        return (h.float() if self.residual_in_fp32 else h) + mix


class Backbone(nn.Module):
    def __init__(self, cfg: MambaConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.target_hidden_size:  # a drafter that reads the target: see `MambaDrafter.embed`
            self.fuse = nn.Linear(cfg.d_model + cfg.target_hidden_size, cfg.d_model, bias=False)
            self.stand_in = nn.Parameter(torch.zeros(cfg.target_hidden_size))
            self.feature_norm = RMSNorm(cfg.target_hidden_size, cfg.norm_eps)


class MambaDrafter(SharedCalls, nn.Module):
    """A Mamba language model on an explicit state whose rows fork: implements `mamba_draft.drafter.Drafter`."""

    capturable = True  # `step` has fixed shapes and no host sync: CUDA-graph capturable

    def __init__(self, config: MambaConfig, backend: str = "auto", state_dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.state_dtype = state_dtype
        # the draft vocabulary (EAGLE-3's d2t, FR-Spec: `set_draft_vocab`); the drafter still reads every token id
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)
        self.head_cache = PackCache()  # the head's prepacked copy (bf16 on CPU; packed_linear)
        self.head_rows = RowKernelCache()  # ... and its copy for few-row steps on a CPU (row_linear)
        self.fused = None  # the 'fused' backend's FusedStep (fused_step.py), made by its first set_backend
        self.compiled = None  # the 'compiled' backend's CompiledStep (cpu_drafter.py), likewise
        self.set_backend(backend)

    @classmethod
    def from_pretrained(cls, path: str, *, revision: str | None = None, embedding: torch.Tensor | None = None,
                        **options) -> "MambaDrafter":
        """Load an HF- or mamba_ssm-format directory, a hub id, or `smollm2` (the shipped drafter); `embedding`: as
        `load_checkpoint` takes it; `options` (device, dtype, backend, state_dtype): as `from_state_dict` takes them."""
        return cls.from_state_dict(*load_checkpoint(path, revision=revision, embedding=embedding), **options)

    @classmethod
    def from_state_dict(cls, config: MambaConfig, tensors: dict[str, torch.Tensor], *, device="cpu",
                        dtype: torch.dtype = torch.float32, backend: str = "auto",
                        state_dtype: torch.dtype | None = None) -> "MambaDrafter":
        with torch.device("meta"):
            model = cls(config, backend="torch", state_dtype=state_dtype)
        model.to_empty(device=device)
        model.load_hf_state_dict(tensors)
        model.to(dtype=dtype)
        model.eval().requires_grad_(False)
        pack_linears(model)  # bf16 on CPU: projections on prepacked weights, same bits
        use_row_kernel(model.backbone)  # a drafting step's few rows on a CPU: the compiled product
        model.set_backend(backend)
        return model

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into the parameters (`check_tensors` names what is missing, unexpected or
        misshaped); a `DRAFT_IDS` entry sets the draft vocabulary."""
        tensors = check_tensors(self, tensors)
        draft_ids = tensors.pop(DRAFT_IDS, None)
        self.load_state_dict(tensors, strict=False, assign=False)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.set_draft_vocab(draft_ids)

    def save_pretrained(self, directory, *, format: str = "hf", overwrite: bool = False) -> None:
        """Write HF format (config.json + model.safetensors) or mamba_ssm format (config.json + pytorch_model.bin)."""
        save_checkpoint(self.config, self.checkpoint_tensors(), directory, format=format, overwrite=overwrite)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict plus, with a draft vocabulary, its id map under `DRAFT_IDS` (written to its own file)."""
        tensors = dict(self.state_dict())
        if self.draft_ids is not None:
            tensors[DRAFT_IDS] = self.draft_ids
        return tensors

    @torch.no_grad()
    def set_draft_vocab(self, draft_ids: torch.Tensor | None) -> None:
        """Restrict proposals to `draft_ids` (distinct target ids), or lift it with None. The head rows are copied
        here (a step reads them contiguous): call it again after changing the head's weights in place."""
        if draft_ids is None:
            self.draft_ids = self.draft_head = None
            return
        self.draft_ids = check_draft_ids(draft_ids, self.config.real_vocab_size, self.device)
        self.draft_head = self.lm_head.weight[self.draft_ids].detach().clone()

    def set_backend(self, backend: str) -> None:
        """'torch' (reference), 'kernels' (mamba-ssm + causal-conv1d on CUDA), 'fused' (our Triton kernels, a few a
        layer: fused_step.py; opt-in until timed on GPUs), 'compiled' (the C step on a CPU: cpu_drafter.py) or 'auto'
        (kernels on CUDA, compiled on a CPU, where usable; else torch)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        on_cuda = self.device.type == "cuda"
        if backend == "auto":
            if on_cuda:
                backend = "kernels" if load_kernels() is not None else "torch"
            else:
                backend = "compiled" if cpu_drafter.applies(self) else "torch"
        if backend == "kernels":
            if not on_cuda:
                raise RuntimeError("backend='kernels' needs the drafter on a CUDA device")
            if load_kernels() is None:
                raise RuntimeError("backend='kernels' needs mamba-ssm and causal-conv1d (pip install "
                                   "'mamba-draft[cuda]' on a CUDA machine); they could not be imported")
        if backend == "fused":
            try:
                from . import fused_step  # imports triton: only when asked for
            except ImportError as err:
                raise RuntimeError("backend='fused' needs triton (a CUDA torch brings it); it could not be imported") \
                    from err
            fused_step.check_fused_device(self.device)
            self.fused = self.fused or fused_step.FusedStep()
        if backend == "compiled":
            if not cpu_drafter.applies(self):
                raise RuntimeError("backend='compiled' needs a Mamba-2 drafter on a CPU in float32 / bfloat16 without "
                                   "projection biases, and a C compiler for its kernel")
            self.compiled = self.compiled or cpu_drafter.CompiledStep()
        self.backend = backend

    @property
    def vocab_size(self) -> int:
        """Width of the logits: the draft vocabulary's, else the real vocabulary's."""
        return self.draft_ids.numel() if self.draft_ids is not None else self.config.real_vocab_size

    @property
    def input_vocab_size(self) -> int:
        """Token ids the drafter reads (its embedding's real rows), whatever its draft vocabulary."""
        return self.config.real_vocab_size

    @property
    def embedding_rows(self) -> int:
        """Ids `prefill` / `extend` accept: every embedding row, padding rows included."""
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def row_bytes(self, context: int = 0) -> int:
        """Bytes of one state row (conv + SSM buffers, every layer): the same at any context length."""
        cfg = self.config
        ssm = (self.state_dtype or self.dtype).itemsize * math.prod(cfg.ssm_state_shape)
        return cfg.n_layer * (self.dtype.itemsize * cfg.conv_dim * cfg.d_conv + ssm)

    def allocate_state(self, max_batch: int) -> DrafterState:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        cfg = self.config
        zeros = lambda *shape, dtype: torch.zeros(cfg.n_layer, max_batch, *shape, device=self.device, dtype=dtype)
        return DrafterState(zeros(cfg.conv_dim, cfg.d_conv, dtype=self.dtype),
                            zeros(*cfg.ssm_state_shape, dtype=self.state_dtype or self.dtype))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from the final norm's output (padded vocabulary rows skipped entirely)."""
        weight = self.lm_head.weight[: self.config.real_vocab_size] if self.draft_head is None else self.draft_head
        h = h.to(weight.dtype)
        logits = self.head_rows.linear(h, weight) if h.dim() == 2 else None
        return self.head_cache.linear(h, weight) if logits is None else logits

    @property
    def reads_target(self) -> bool:
        """Whether this drafter reads the target's final hidden state beside each token (`embed`)."""
        return self.config.target_hidden_size > 0

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input for tokens (B, L) or (B,). A drafter that reads the target fuses (EAGLE) each token's
        embedding with `features` (B, L, H) / (B, H), the target's final hidden state at the position before it, or
        with the learned `stand_in` where the target has not computed one (features None). `feature_norm` first
        brings that state to the embedding's scale, so it does not swamp the token. An external drafter takes none."""
        h = self.backbone.embeddings(input_ids)
        if not self.reads_target:
            if features is not None:
                raise ValueError("this drafter reads token ids only (target_hidden_size 0): pass no features")
            return h
        if features is None:
            features = self.backbone.stand_in.expand(*input_ids.shape, -1)
        elif features.shape != (*input_ids.shape, self.config.target_hidden_size):
            raise ValueError(f"features must have shape {(*input_ids.shape, self.config.target_hidden_size)} (one "
                             f"target state per token), got {tuple(features.shape)}")
        return self.backbone.fuse(torch.cat([h, self.backbone.feature_norm(features.to(h.dtype))], dim=-1))

    def _run(self, input_ids: torch.Tensor, state: DrafterState | None, features: torch.Tensor | None = None,
             one_position: bool = False) -> torch.Tensor:
        """Hidden states (B, L, d_model) for a block continuing rows [0:B] of `state` (None: from zero, kept nowhere);
        with `one_position`, (B, d_model) for one token per row (B,) by the torch step."""
        h = self.embed(input_ids, features)
        batch = input_ids.shape[0]
        for i, layer in enumerate(self.backbone.layers):
            rows = (None, None) if state is None else (state.conv[i, :batch], state.ssm[i, :batch])
            h = layer(h, *rows, one_position)
        return h

    def train_forward(self, input_ids: torch.Tensor, features: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward: differentiable logits (B, L, vocab_size) from a zero state by the chunked scans, and
        the final-norm states (B, L, d_model); draft-vocabulary head rows gathered here, so gradients reach them."""
        ids = input_ids.to(device=self.device, dtype=torch.long)
        h = self.backbone.norm_f(self._run(ids, None, features))
        weight = self.lm_head.weight[: self.config.real_vocab_size] if self.draft_ids is None \
            else self.lm_head.weight[self.draft_ids]
        return F.linear(h.to(weight.dtype), weight), h

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, state: DrafterState, *, last_only: bool = False,
               features: torch.Tensor | None = None, with_hidden: bool = False):
        """Continue rows [0:B] of `state` with a (B, L) block of tokens (and their `features`, `embed`); returns
        logits (B, L, V) or (B, V), with `with_hidden` also the final-norm states ('own' drafted features)."""
        input_ids = self.token_ids(input_ids)
        check_batch(input_ids.shape[0], state)
        h = self._run(input_ids, state, features)
        normed = self.backbone.norm_f(h[:, -1] if last_only else h)
        return (self._head(normed), normed) if with_hidden else self._head(normed)

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, state: DrafterState, features: torch.Tensor | None = None,
             with_hidden: bool = False):
        """Feed one token per row (B,) (and, reading the target, its feature (B, H), `embed`) to rows [0:B] of
        `state` (in place); returns logits (B, V), with `with_hidden` also the final-norm states (B, d) (`extend`)."""
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"token ids must be an int64/int32 tensor, got "
                            f"{token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__}")
        if token_ids.dim() != 1:
            raise ValueError(f"step takes one token per row, shape (B,), got {tuple(token_ids.shape)}")
        batch = check_batch(token_ids.shape[0], state)
        if self.backend == "compiled" and self.device.type == "cpu":
            logits, normed = self.compiled(self, token_ids, state, features)
            return (logits, normed) if with_hidden else logits
        if self.backend == "fused":
            normed = self.fused(self, token_ids, state, features)
        elif self.backend == "kernels":
            kernels, residual, h = load_kernels(), None, self.embed(token_ids, features)
            fp32 = self.config.residual_in_fp32
            for i, layer in enumerate(self.backbone.layers):  # each norm adds the residual, as mamba-ssm's blocks do
                x, residual = kernels.rms_norm(h, layer.norm.weight, None, residual=residual, prenorm=True,
                                               residual_in_fp32=fp32, eps=layer.norm.eps)
                h = layer.mixer.step(x, state.conv[i, :batch], state.ssm[i, :batch], kernels)
            norm = self.backbone.norm_f
            normed = kernels.rms_norm(h, norm.weight, None, residual=residual, prenorm=False, residual_in_fp32=fp32,
                                      eps=norm.eps)
        else:
            normed = self.backbone.norm_f(self._run(token_ids, state, features, one_position=True))
        return (self._head(normed), normed) if with_hidden else self._head(normed)
