"""Losses: shifted cross-entropy over labelled positions, forward KL to the target on the shared vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from training.data import IGNORE_INDEX
from training.loss import cross_entropy, forward_kl


def test_cross_entropy_is_shifted_and_masked():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    labels[0, 1:3] = IGNORE_INDEX
    keep = labels[:, 1:] != IGNORE_INDEX
    expected = F.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(cross_entropy(logits, labels), expected)


def test_forward_kl_matches_kl_div_on_labelled_positions_and_shared_vocab():
    g = torch.Generator().manual_seed(1)
    drafter, target = torch.randn(2, 6, 12, generator=g), torch.randn(2, 6, 10, generator=g)  # padded vocabs differ
    labels = torch.randint(0, 8, (2, 6), generator=g)
    labels[1, :4] = IGNORE_INDEX
    keep = labels[:, 1:] != IGNORE_INDEX
    log_q = F.log_softmax(drafter[:, :-1, :8][keep] / 2.0, -1)
    log_p = F.log_softmax(target[:, :-1, :8][keep] / 2.0, -1)
    expected = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * 4.0
    torch.testing.assert_close(forward_kl(drafter, target, labels, vocab=8, temperature=2.0), expected)
    assert forward_kl(target, target, labels, vocab=8).abs() < 1e-6
    # positions without a label do not matter
    changed = drafter.clone()
    changed[1, :3] += 5.0
    torch.testing.assert_close(forward_kl(changed, target, labels, vocab=8), forward_kl(drafter, target, labels, vocab=8))
