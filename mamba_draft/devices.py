"""Device names from the command line, checked before any model loads."""
from __future__ import annotations

import torch


def check_device(name: str, flag: str = "--device") -> None:
    """Refuse a device this machine cannot use, in one line, before any model loads (torch itself answers an
    AssertionError for 'cuda' without CUDA, and a multi-line RuntimeError for a missing ordinal)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{flag} {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{flag} {name}: CUDA is not available on this machine")
        if (device.index or 0) >= count:
            raise ValueError(f"{flag} {name}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as err:  # mps / xpu / ... not built or not present
            raise ValueError(f"{flag} {name}: not usable on this machine ({' '.join(str(err).split())})") from None
