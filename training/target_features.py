"""What a drafter that reads the target (`model.target_hidden_size` > 0) is fed in training.

At inference the drafter reads, beside each token, the target's final hidden state at the position before it
wherever the target has computed it (committed reply tokens); prompt tokens and tokens drafted inside a round get
the drafter's learned `stand_in`. Training reproduces that pattern in one parallel pass (HASS / EAGLE-3's
training-time test, adapted to a recurrent drafter): reply rows get the cached states, prompt rows the stand-in, and
simulated draft windows (`window_mask`) put the stand-in on the 1..K-1 reply positions after a root. A recurrent
pass cannot forget a window (the positions after it continue from a state that read it): `distill.window_rate`
keeps windows a minority of positions.

With `model.drafted_features: own` a drafted token reads the drafter's own final-norm state where it predicted it
(EAGLE); training feeds window rows that state from a first pass without gradients (`own_features`): exact at depth
2, an approximation deeper.
"""
from __future__ import annotations

import numpy as np
import torch


def window_mask(reply: torch.Tensor, k: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """(B, L) bool: the positions inside simulated draft windows.

    `reply` (B, L) bool marks reply rows. Each reply row r opens a window with probability `rate`; a window has a
    length d uniform in 1..k-1 and covers rows r+1..r+d, stopping early at the first row that is not a reply row.
    The draws are of fixed shape, so the mask depends only on the generator's seed and the batch's shape and rows."""
    if reply.dim() != 2 or reply.dtype != torch.bool:
        raise ValueError(f"reply must be a (B, L) bool mask, got {reply.dtype} {tuple(reply.shape)}")
    if k < 0 or k == 1:
        raise ValueError(f"draft windows K must be 0 (off) or >= 2, got {k}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"window rate must lie in [0, 1], got {rate}")
    device, reply = reply.device, reply.cpu()
    covered = torch.zeros_like(reply)
    if k < 2 or rate == 0.0:
        return covered.to(device)
    opens = torch.rand(reply.shape, generator=generator) < rate
    length = torch.randint(1, k, reply.shape, generator=generator)
    alive = opens & reply  # alive[r]: the window rooted at r still covers row r + j
    width = reply.shape[1]
    for j in range(1, min(k, width)):
        alive = alive[:, :width - j] & (length[:, :width - j] >= j) & reply[:, j:]
        covered[:, j:] |= alive
    return covered.to(device)


def window_generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """The generator of one micro-batch's windows: a function of (run seed, rank, optimizer step, micro-batch),
    never of the RNG's history, so a resumed run draws the windows it would have drawn."""
    state = np.random.SeedSequence([seed, rank, step, micro]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def known_rows(labels: torch.Tensor, windows: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L) bool: rows fed the target's cached state — reply rows (labelled: the target generated them) outside
    draft windows. `labels` are the batch's own (target ids, before any draft-vocabulary mapping)."""
    from training.data import IGNORE_INDEX

    known = labels != IGNORE_INDEX
    return known & ~windows if windows is not None else known


def fed_features(hidden: torch.Tensor, known: torch.Tensor, stand_in: torch.Tensor) -> torch.Tensor:
    """(B, L, H): `hidden` where `known`, the `stand_in` (H,) elsewhere (it gets the gradients of those rows)."""
    if hidden.shape[:-1] != known.shape or hidden.shape[-1] != stand_in.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, known {tuple(known.shape)} and stand_in "
                         f"{tuple(stand_in.shape)} disagree")
    return torch.where(known[..., None], hidden.to(stand_in.dtype), stand_in)


def own_features(features: torch.Tensor, own: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """(B, L, H): `features`, with each `own` row t replaced by the drafter's own final-norm state at row t - 1
    (`hidden`, (B, L, H), from a pass on `features`). Row 0 has no row before and is never `own`."""
    if own.shape != features.shape[:-1] or hidden.shape != features.shape:
        raise ValueError(f"features {tuple(features.shape)}, own {tuple(own.shape)} and hidden "
                         f"{tuple(hidden.shape)} disagree")
    if own[:, 0].any():
        raise ValueError("row 0 cannot read the drafter's state at the row before it")
    before = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
    return torch.where(own[..., None], before.to(features.dtype), features)
