"""Device names from the command line, checked before any model loads."""
from __future__ import annotations

import os
import shutil

import torch

from .dtypes import parse_dtype


def check_device(name: str) -> None:
    """Refuse a device this machine cannot use, in one line, before any model loads (torch itself answers an
    AssertionError for 'cuda' without CUDA, and a multi-line RuntimeError for a missing ordinal)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
        if (device.index or 0) >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as err:  # mps / xpu / ... not built or not present
            raise ValueError(f"--device {name}: not usable on this machine ({' '.join(str(err).split())})") from None


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """bf16 matrix products run in hardware here: a CUDA GPU that supports bf16, or a CPU with AVX512-BF16 or AMX
    (Intel Xeons since Cooper Lake, AMD EPYCs since Zen 4). Elsewhere bf16 is emulated and slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = cpu_info("flags").split() if device.type == "cpu" else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_info(field: str) -> str:
    """The value of /proc/cpuinfo's first `field` line ("" without one, or without /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def c_compiler() -> str | None:
    """$CC, else gcc, else cc: the path of one that runs here, or None (what builds the exact bf16 CPU attention)."""
    return next((path for name in (os.environ.get("CC"), "gcc", "cc") if name and (path := shutil.which(name))), None)


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """A target's dtype when none is asked for: bf16 where its products are native (`native_bf16`) and, on a CPU,
    a C compiler can build the exact attention kernel (`targets.row_attention`), else fp32."""
    if torch.device(device).type == "cpu" and c_compiler() is None:
        return torch.float32
    return torch.bfloat16 if native_bf16(device) else torch.float32


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """A --dtype value: "auto" is `default_dtype(device)`, anything else a name `parse_dtype` knows."""
    return default_dtype(device) if name == "auto" else parse_dtype(name)
