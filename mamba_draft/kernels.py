"""Optional CUDA kernels (mamba-ssm's Triton `selective_state_update`, causal-conv1d's `causal_conv1d_update`).

Both packages fail to import without CUDA (they import `selective_scan_cuda` / `causal_conv1d_cuda` eagerly), so
they are looked up lazily and any import failure means "not available" — never a hard dependency.
"""
from __future__ import annotations

import functools


@functools.cache
def load_kernels():
    """Return (selective_state_update, causal_conv1d_update), or None when either cannot be imported."""
    try:
        from causal_conv1d import causal_conv1d_update
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception:  # ImportError, or RuntimeError/TypeError from half-installed CUDA extensions
        return None
    return selective_state_update, causal_conv1d_update


def kernels_available() -> bool:
    return load_kernels() is not None
