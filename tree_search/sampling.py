"""Temperature / top-k / top-p processing shared by draft and target, and host-sync-free sampling helpers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 = greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed distribution (..., V) in float32: one-hot argmax when greedy, else softmax(logits / T)
    restricted to the top-k tokens and then to the smallest top-p nucleus (HF warper order)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the top token always stays (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A seeded generator on `device`, or None (torch's global RNG) when no seed is given."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of `probs` (..., V) -> (...,), via argmax(p / Exp(1)): exact and no host sync."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def sample_without_replacement(probs: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n distinct draws per row, in draw order, without replacement (Gumbel/exponential top-k).

    Ranking p / E with E ~ Exp(1) is the Plackett–Luce order, i.e. successive draws from the renormalised
    remainder. Rows with fewer than n supported tokens are padded with zero-probability tokens, which
    verifiers must skip (they were never drawn).
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.topk(probs / noise, n, dim=-1).indices
