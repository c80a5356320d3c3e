"""Optional CUDA kernels of the drafter's step: mamba-ssm's Triton `selective_state_update` and `rms_norm_fn` (the
residual add fused into the RMSNorm, as mamba-ssm's own blocks run it), causal-conv1d's `causal_conv1d_update`.

Looked up lazily, any import failure meaning "not available": never a hard dependency. A Triton-only install
(`MAMBA_SKIP_CUDA_BUILD=TRUE pip install mamba-ssm`) lacks the compiled scan `import mamba_ssm` imports: the Triton
modules are then loaded past the package `__init__`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import types
from typing import Callable, NamedTuple


class Kernels(NamedTuple):
    selective_state_update: Callable  # one SSM step (dt bias, softplus, D and the z gate inside)
    causal_conv1d_update: Callable  # one conv step on the rolling conv state
    rms_norm: Callable  # rms_norm_fn: RMSNorm(x + residual), returning the new residual too (prenorm=True)


def _triton_function(module: str, name: str):
    """`name` from mamba-ssm's Triton `module`, loaded past the package's `__init__` when that fails."""
    with contextlib.suppress(Exception):  # else the package __init__ (compiled scan, Mamba-3) failed
        return getattr(importlib.import_module(module), name)
    spec = importlib.util.find_spec("mamba_ssm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba_ssm is not installed")
    _forget_mamba_ssm()  # what the failed attempt half-imported
    parts = module.split(".")
    for depth in range(1, len(parts) - 1):  # bare packages mamba_ssm, mamba_ssm.ops, mamba_ssm.ops.triton
        package = types.ModuleType(".".join(parts[:depth]))
        package.__path__ = [os.path.join(root, *parts[1:depth]) for root in spec.submodule_search_locations]
        sys.modules[package.__name__] = package
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        _forget_mamba_ssm()
        raise


def _forget_mamba_ssm() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "mamba_ssm"]:
        del sys.modules[name]


@functools.cache
def load_kernels() -> Kernels | None:
    """The step's kernels, or None when any cannot be imported."""
    try:
        from causal_conv1d import causal_conv1d_update

        return Kernels(_triton_function("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
                       causal_conv1d_update, _triton_function("mamba_ssm.ops.triton.layer_norm", "rms_norm_fn"))
    except Exception:  # ImportError, or RuntimeError/TypeError from half-installed CUDA extensions
        return None


def kernels_available() -> bool:
    return load_kernels() is not None
