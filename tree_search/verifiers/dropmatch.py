"""DropMatch: Monte-Carlo dropout on the target's LM head only, as K cheap "heads" that judge draft tokens.

Each node's target final hidden state goes through K independent inverted-dropout masks and the LM head. Criteria:
- `naive` (Eq. 4): accept the draft token if it equals any head's choice (argmax when greedy, else a sample).
- `js` (Eqs. 5-7): accept if JS(q, c) <= max_k JS(p_k, c), c = softmax(mean of head logits), q the draft
  distribution, or if the token is the heads' plurality token. On a tree all siblings share q, so a JS acceptance
  admits every sibling: the default is `naive` (as the paper's on EAGLE-3 trees) and `js` suits chains.
Distributions are compared at the sampling temperature (temperature 1 when greedy); p = 0 ≡ greedy.
"""
from __future__ import annotations

from typing import Callable

import torch

from tree_search.sampling import SamplingParams, choose, soft_probs
from tree_search.verifiers.base import VerifyInput, register_verifier
from tree_search.verifiers.lossy import LossyVerifier, Paths

CRITERIA = ("naive", "js")


def dropout_head_logits(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], p: float,
                        num_heads: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(N, H) hidden states -> (K, N, V) logits of K independent inverted-dropout passes through `lm_head`.

    p = 0 computes `lm_head(hidden)` once and draws no mask (a batch of K identical rows may take another kernel and
    differ in the last bit), so DropMatch at p = 0 accepts exactly what the target's own head picks."""
    if p == 0.0:
        return lm_head(hidden).expand(num_heads, *hidden.shape[:-1], -1)
    keep = torch.empty((num_heads, *hidden.shape), device=hidden.device, dtype=hidden.dtype)
    keep.bernoulli_(1.0 - p, generator=generator)
    return lm_head(hidden * keep / (1.0 - p))


def js_divergence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (natural log) between distributions over the last dim."""
    m = 0.5 * (a + b)
    kl_am = (torch.xlogy(a, a) - torch.xlogy(a, m)).sum(-1)
    kl_bm = (torch.xlogy(b, b) - torch.xlogy(b, m)).sum(-1)
    return 0.5 * (kl_am + kl_bm)


def naive_accept(tokens: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """Eq. 4: (N,) tokens, (K, N) head choices -> (N,) token equals some head's choice."""
    return (choices == tokens).any(dim=0)


def js_accept(tokens: torch.Tensor, head_logits: torch.Tensor, choices: torch.Tensor, draft_probs: torch.Tensor,
              sampling: SamplingParams) -> torch.Tensor:
    """Eqs. 6-7: (N,) accept if JS(q, c) <= max_k JS(p_k, c) or the token is the heads' plurality token."""
    heads = soft_probs(head_logits, sampling)  # (K, N, V)
    centroid = soft_probs(head_logits.mean(dim=0), sampling)  # (N, V)
    vocab = max(draft_probs.shape[-1], centroid.shape[-1])  # padded vocabularies: missing tokens have mass 0
    q, heads, centroid = (torch.nn.functional.pad(t, (0, vocab - t.shape[-1]))
                          for t in (draft_probs.float(), heads, centroid))
    spread = js_divergence(heads, centroid).amax(dim=0)  # (N,)
    close = js_divergence(q, centroid) <= spread
    majority = torch.mode(choices, dim=0).values  # ties: torch.mode's pick
    return close | (tokens == majority)


@register_verifier
class DropMatchVerifier(LossyVerifier):
    """DropMatch, `lossless = False`. p: dropout probability in [0, 1); num_heads: K >= 1; seed: mask RNG seed."""

    name = "dropmatch"
    needs_hidden = True

    def __init__(self, p: float = 0.1, num_heads: int = 5, criterion: str = "naive", seed: int = 0) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"dropmatch: dropout probability p must be in [0, 1), got {p!r}")
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"dropmatch: number of heads K must be an integer >= 1, got {num_heads!r}")
        if criterion not in CRITERIA:
            raise ValueError(f"dropmatch: unknown criterion {criterion!r}; choose one of {CRITERIA}")
        self.p, self.num_heads, self.criterion, self.seed = float(p), num_heads, criterion, int(seed)
        self.needs_draft_probs = criterion == "js"
        # one seeded mask RNG per device, advancing across calls: a run is reproducible from `seed`
        self._generators: dict[torch.device, torch.Generator] = {}

    def lossy_mask(self, inp: VerifyInput, paths: Paths) -> torch.Tensor:
        """The path nodes whose token the heads at its parent accept."""
        if inp.hidden is None or inp.lm_head is None:
            raise ValueError("dropmatch needs the target's final hidden states and LM head (VerifyInput.hidden/lm_head)")
        if self.criterion == "js" and inp.draft_probs is None:
            raise ValueError("dropmatch criterion 'js' needs the draft distributions (VerifyInput.draft_probs)")
        device = inp.hidden.device
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        generator = self._generators[device]
        with torch.no_grad():
            head_logits = dropout_head_logits(inp.hidden, inp.lm_head, self.p, self.num_heads, generator)
        parents = paths.node_parents
        choices = choose(head_logits, inp.sampling, generator)[:, parents]  # one draw per position
        if self.criterion == "naive":
            return paths.on_paths(naive_accept(inp.tokens, choices))
        return paths.on_paths(js_accept(inp.tokens, head_logits[:, parents], choices, inp.draft_probs[parents],
                                        inp.sampling))
