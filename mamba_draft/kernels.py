"""Optional CUDA kernels (mamba-ssm's Triton `selective_state_update`, causal-conv1d's `causal_conv1d_update`).

Both packages fail to import without CUDA (they import `selective_scan_cuda` / `causal_conv1d_cuda` eagerly), so
they are looked up lazily and any import failure means "not available" — never a hard dependency.

Decoding needs only mamba-ssm's Triton step, which compiles nothing at install time; but `import mamba_ssm` runs a
package `__init__` that imports the compiled prefill scan (and Mamba-3's extra dependencies). A Triton-only install
(`MAMBA_SKIP_CUDA_BUILD=TRUE pip install mamba-ssm`) therefore fails that import, and the step module is then loaded
from the installed files without running the package's `__init__`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types

STEP_MODULE = "mamba_ssm.ops.triton.selective_state_update"


def _selective_state_update():
    try:
        return importlib.import_module(STEP_MODULE).selective_state_update
    except Exception:  # the package __init__ (compiled scan, Mamba-3) failed: try the Triton module alone
        pass
    spec = importlib.util.find_spec("mamba_ssm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba_ssm is not installed")
    _forget_mamba_ssm()  # what the failed attempt half-imported
    parts = STEP_MODULE.split(".")
    for depth in range(1, len(parts) - 1):  # bare packages mamba_ssm, mamba_ssm.ops, mamba_ssm.ops.triton
        name = ".".join(parts[:depth])
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *parts[1:depth]) for root in spec.submodule_search_locations]
        sys.modules[name] = package
    try:
        return importlib.import_module(STEP_MODULE).selective_state_update
    except Exception:
        _forget_mamba_ssm()
        raise


def _forget_mamba_ssm() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "mamba_ssm"]:
        del sys.modules[name]


@functools.cache
def load_kernels():
    """Return (selective_state_update, causal_conv1d_update), or None when either cannot be imported."""
    try:
        from causal_conv1d import causal_conv1d_update

        selective_state_update = _selective_state_update()
    except Exception:  # ImportError, or RuntimeError/TypeError from half-installed CUDA extensions
        return None
    return selective_state_update, causal_conv1d_update


def kernels_available() -> bool:
    return load_kernels() is not None
