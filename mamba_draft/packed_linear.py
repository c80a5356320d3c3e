"""bf16 linear layers on CPU with their weight prepacked for oneDNN: the same bits as `F.linear`, faster for the
few-row products of decoding (a bf16 `F.linear` reorders the weight into oneDNN's blocked layout on every call).
Packed only where a probe shows the same bits (fp32's packed kernels round differently; a oneDNN held to AVX2 refuses
bf16). Autograd goes through `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def exact_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed weight, if its outputs are bit-identical to F.linear's here (1, 2 and 7 rows probed), else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):  # no bf16 support in this oneDNN / CPU, or a torch without the op
        return None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (1, 2, 7):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
            if not torch.equal(_packed_linear(x, packed, None), F.linear(x, weight.detach())):
                return None
    return packed


def packs_exactly(weight: torch.Tensor) -> bool:
    return exact_pack(weight) is not None


class PackCache:
    """The packed copy of the weight last given to `linear` (not copied or pickled: a copy starts empty)."""

    def __init__(self) -> None:
        self.storage = None  # the packed weight's storage, held: no other tensor can come to share its address
        self.key: tuple | None = None
        self.packed: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias), on the packed weight where that gives the same bits (bf16, CPU, no grad)."""
        if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
                or weight.device.type != "cpu" or x.dim() < 2 or (bias is not None and bias.dtype != x.dtype)
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return F.linear(x, weight, bias)
        if not self.holds(weight):
            self.remember(weight, exact_pack(weight))
        if self.packed is None:  # this weight does not pack to the same bits here
            return F.linear(x, weight, bias)
        return _packed_linear(x, self.packed, bias)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the packed copy is of this very weight, unchanged since."""
        return (self.storage is not None and weight.untyped_storage()._cdata == self.storage._cdata
                and self.key == (weight.data_ptr(), weight._version, weight.shape, weight.stride()))

    def remember(self, weight: torch.Tensor, packed: torch.Tensor | None) -> None:
        """Keep `packed` (None: this weight does not pack exactly) as the copy of `weight` as it is now."""
        self.packed, self.storage = packed, weight.untyped_storage()
        self.key = (weight.data_ptr(), weight._version, weight.shape, weight.stride())

    def __getstate__(self) -> dict:  # copy.deepcopy goes through it too
        return {"storage": None, "key": None, "packed": None}


class PackedLinear(nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose bf16 CPU inference runs on a prepacked weight."""

    @classmethod
    def wrap(cls, linear: nn.Linear) -> "PackedLinear":
        """`linear` itself, made a PackedLinear: its Parameters (ties), hooks and state dict stay as they are."""
        linear.__class__ = cls
        linear.cache = PackCache()
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cache.linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse=True):  # .to() / .float() / .cuda(): drop the packed copy of the old weight now
        self.cache = PackCache()
        return super()._apply(fn, recurse)


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 CPU nn.Linear of `model` that packs exactly for a PackedLinear (in place); how many."""
    swapped = 0
    for layer in list(model.modules()):
        packed = exact_pack(layer.weight) if type(layer) is nn.Linear else None
        if packed is not None:
            PackedLinear.wrap(layer).cache.remember(layer.weight, packed)  # probed and packed once, here
            swapped += 1
    return swapped
