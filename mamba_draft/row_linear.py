"""A drafter's few-row products on a CPU through the compiled target step's product (`targets/cpu_step.c`'s
`linear`): one pass over a packed copy of the weight (bf16 values kept in bf16: half a float32 weight's bytes) for
the 1-16 rows a drafting step multiplies, where MKL / oneDNN spend most of a small drafter's step on such shapes.

Only drafters use it: their proposals are verified, so their products need not have F.linear's bits (the kernel's
are its own: one sequential sum per output, the same for a row alone or among others). Many rows (a prompt's
prefill), gradients, other devices and dtypes, MAMBA_DRAFT_CPU_STEP=0 or a machine without a C compiler take the
module's own forward.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from .packed_linear import PackedLinear
from .targets import cpu_step

MAX_ROWS = 16  # beyond, a prompt's block: the library's blocked kernels are faster


class RowKernelCache:
    """One weight's copy in the kernel's layout (`cpu_step.encode`), made again when the weight changes."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.held: tuple = ()  # the weight's storage (no other tensor comes to share its address) and the copy
        self.weight: cpu_step.Weight | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x @ weight.T + bias for x (rows, in) by the kernel, or None where it does not apply."""
        if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16)
                or weight.dtype != x.dtype or x.dim() != 2 or x.shape[0] > MAX_ROWS
                or (bias is not None and bias.dtype != x.dtype)
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
                or os.environ.get(cpu_step.SWITCH) == "0" or not cpu_step.available()):
            return None
        rows, outs = x.shape[0], weight.shape[0]
        padded = -(-outs // cpu_step.LANES) * cpu_step.LANES  # the kernel's products run over whole 16-row blocks
        key = (weight.data_ptr(), weight._version, weight.shape, weight.stride())
        if key != self.key:
            data, bits = cpu_step.encode(nn.functional.pad(weight.detach(), (0, 0, 0, padded - outs)))
            self.key, self.held = key, (weight.untyped_storage(), data)
            self.weight = cpu_step.Weight(data.data_ptr(), bits)
        inputs = x.detach().float().contiguous()
        if bias is not None:
            bias = nn.functional.pad(bias.detach(), (0, padded - outs))
        out = torch.empty(rows, padded)
        failed = cpu_step.library().cpu_linear(
            inputs.data_ptr(), rows, inputs.shape[1], self.weight, None if bias is None else bias.data_ptr(), padded,
            out.data_ptr(), cpu_step.DTYPES[x.dtype], torch.get_num_threads())
        return None if failed else out[:, :outs].to(x.dtype)

    def __getstate__(self) -> dict:  # a copy starts empty (copy.deepcopy goes through it too)
        return {"key": None, "held": (), "weight": None}


class RowKernelLinear(PackedLinear):
    """An nn.Linear (same parameters and state dict) whose few-row CPU inference runs on the kernel."""

    @classmethod
    def wrap(cls, linear: nn.Linear) -> RowKernelLinear:
        if not isinstance(linear, PackedLinear):
            PackedLinear.wrap(linear)
        linear.__class__ = cls
        linear.rows = RowKernelCache()
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rows.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias) if x.dim() >= 2 else None
        return super().forward(x) if out is None else out.view(*x.shape[:-1], -1)

    def _apply(self, fn, recurse=True):  # .to() / .float(): drop the copy of the old weight now
        self.rows = RowKernelCache()
        return super()._apply(fn, recurse)


def use_row_kernel(model: nn.Module) -> None:
    """Make every nn.Linear of `model` a RowKernelLinear (in place; parameters, ties and state dict unchanged)."""
    for layer in list(model.modules()):
        if type(layer) in (nn.Linear, PackedLinear):
            RowKernelLinear.wrap(layer)
