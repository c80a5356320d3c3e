"""Losses over labelled positions only: next-token cross-entropy, forward KL to a frozen target, and a feature loss
to the target's final hidden state."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from training.data import IGNORE_INDEX


def shift(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position t predicts token t+1."""
    return logits[:, :-1].float(), labels[:, 1:]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits, labels = shift(logits, labels)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def forward_kl(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, vocab: int,
               temperature: float = 1.0) -> torch.Tensor:
    """Mean over labelled positions of KL(p_target || q_drafter) on the shared `vocab` (padding rows dropped)."""
    logits, labels = shift(logits[..., :vocab], labels)
    target_logits = target_logits[:, :-1, :vocab].float()
    mask = labels != IGNORE_INDEX
    log_q = F.log_softmax(logits[mask] / temperature, dim=-1)
    log_p = F.log_softmax(target_logits[mask] / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() * temperature ** 2  # T^2 keeps gradient scale independent of T (Hinton et al.)


def cached_kl(logits: torch.Tensor, soft_ids: torch.Tensor, soft_logp: torch.Tensor, labels: torch.Tensor,
              to_draft: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over labelled positions of KL(p || q), p the target's cached top-K distribution renormalised over the
    ids the drafter can emit (its draft vocabulary, when `to_draft` maps target ids to draft columns, -100 outside).
    soft_ids / soft_logp (B, L, K): row t is the distribution token t was predicted from (aligned with labels)."""
    logits, labels = shift(logits, labels)
    ids, logp = soft_ids[:, 1:], soft_logp[:, 1:].float()
    mask = labels != IGNORE_INDEX
    ids, logp = ids[mask], logp[mask]
    if to_draft is not None:  # ids past the map (a target's padded vocabulary rows) are outside it too
        ids = torch.where(ids < to_draft.numel(), to_draft[ids.clamp(max=to_draft.numel() - 1)], -1)
        logp = logp.masked_fill(ids < 0, float("-inf"))
        ids = ids.clamp(min=0)
    log_p = F.log_softmax(logp, dim=-1)
    p = log_p.exp()
    log_q = F.log_softmax(logits[mask], dim=-1).gather(-1, ids)
    return (p * (log_p - log_q)).nan_to_num(0.0).sum(-1).mean()  # 0 * (-inf) outside the vocabulary: no term


def feature_loss(hidden: torch.Tensor, target_hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over labelled positions and features of SmoothL1(drafter's final hidden state, the target's) (EAGLE).

    hidden (B, L, d): the drafter's final-norm state at position t, which predicts token t+1; target_hidden
    (B, L, d): row t is the target's state its distribution for token t came from (aligned with labels). With the
    target's tied embedding as head, matching the state matches the target's logits over the whole vocabulary."""
    mask = labels[:, 1:] != IGNORE_INDEX
    return F.smooth_l1_loss(hidden[:, :-1][mask].float(), target_hidden[:, 1:][mask].float())
