"""The law of a sampler's first tokens: exact, empirical, and a bound a lossless sampler exceeds w.p. < δ.

Bound on the total-variation distance between the empirical and the exact distribution over K outcomes, N runs:
  E[TV] = ½ Σ_k E|p̂_k − p_k| ≤ ½ Σ_k sqrt(p_k (1 − p_k) / N)                    (Jensen, binomial variance)
  TV is a function of N independent runs, each changing it by at most 1/N, so by McDiarmid
  P(TV ≥ E[TV] + ε) ≤ exp(−2 N ε²);  ε = sqrt(ln(1/δ) / (2N)) (0.0263 at N = 10,000, δ = 1e-6).
A broken rule whose law sits at TV d from the exact one fails the check w.p. ≥ 1 − δ once d > 2 × bound.

Runs go in batches: row b of a batch is seeded seed + b and draws exactly what the single-prompt call with that
seed draws (tests/test_batch_generate.py), so a batch of rows is that many independent runs at a fraction of the
cost.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from tree_search.sampling import SamplingParams, logits_to_probs


def exact_first_two(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """(V, V) exact P(x1, x2) under the target's processed distribution after `prompt`."""
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params)
        vocab = first.numel()
        seconds = torch.cat([torch.tensor([prompt]).repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = logits_to_probs(target(seconds).logits[:, -1], params)
    return (first[:, None] * second).double()


def tv_bound(p: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    return 0.5 * torch.sqrt(p * (1 - p) / n).sum().item() + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical(outcomes: list[tuple[int, ...]], shape: tuple[int, ...]) -> torch.Tensor:
    """Frequencies of each outcome (a tuple of token ids) in a tensor of `shape`."""
    counts = torch.zeros(shape, dtype=torch.float64)
    for outcome in outcomes:
        counts[outcome] += 1
    return counts / len(outcomes)


def seeded_runs(run: Callable[[int, int], list[list[int]]], n: int, batch: int) -> list[list[int]]:
    """Outcomes of runs seeded 0..n-1: run(seed, rows) returns the new tokens of `rows` runs seeded seed, seed+1..."""
    out = []
    for seed in range(0, n, batch):
        out += run(seed, min(batch, n - seed))
    return out


def assert_follows(observed: torch.Tensor, exact: torch.Tensor, n: int) -> None:
    tv = 0.5 * (observed - exact).abs().sum().item()
    assert tv < tv_bound(exact, n), f"TV {tv:.4f} vs bound {tv_bound(exact, n):.4f}"
