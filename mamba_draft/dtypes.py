"""The one table of floating-point dtype names used on command lines and in configs."""
from __future__ import annotations

import torch

# canonical name -> dtype, in the order command lines offer them
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_dtype(name: str | torch.dtype, *, auto: bool = False) -> torch.dtype | str:
    """The torch dtype named `name` (canonical name or alias; a dtype of the table passes through); with
    `auto=True`, "auto" as is (for loaders that pick the checkpoint's own dtype)."""
    if (isinstance(name, torch.dtype) and name in DTYPES.values()) or (auto and name == "auto"):
        return name
    if isinstance(name, str) and ALIASES.get(name, name) in DTYPES:
        return DTYPES[ALIASES.get(name, name)]
    known = ["auto"] * auto + [f"{canonical}/{alias}" for alias, canonical in ALIASES.items()]
    raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(known)}")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype in the table ("float32", "bfloat16", "float16")."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype!r} has no name here; supported: {', '.join(DTYPES)}")
