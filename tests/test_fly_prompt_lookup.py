"""Prompt lookup: `NgramLookup` (proposals the target verifies) and FLy's multi-level acceleration (proposals
pre-verified by the Mamba drafter)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tree_models import random_drafter
from tree_search.prompt_lookup import NgramLookup, draft_chain_with_lookup, lookup_proposal


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("drafter"), vocab=64)


def greedy_chain(drafter, context: torch.Tensor, n: int) -> list[int]:
    """The drafter's greedy chain, one step per token (the reference)."""
    logits, state = drafter.prefill(context.view(1, -1))
    token, out = logits[0].argmax(), []
    for _ in range(n):
        out.append(int(token))
        token = drafter.step(token.view(1), state)[0].argmax()
    return out


def lookup_chain(drafter, context: torch.Tensor, n: int):
    state = drafter.allocate_state(2)
    logits, _ = drafter.prefill(context.view(1, -1), state=state)
    return draft_chain_with_lookup(drafter, state, logits[0], context, n)


def test_ngram_lookup_proposes_after_the_latest_occurrence_of_the_longest_ngram():
    lookup = NgramLookup([1, 2, 3, 4, 9, 1, 2, 3, 7, 2, 3], num_tokens=3)
    assert lookup.propose() == [7, 2, 3]  # (2, 3) last occurred before 7; the 4-gram and 3-gram never recurred
    lookup.extend([4])  # (2, 3, 4) occurred once: the 3-gram wins over the 2-gram (3, 4)
    assert lookup.propose() == [9, 1, 2]
    assert NgramLookup([1, 2, 3, 4, 9, 1, 2, 3, 4], num_tokens=8).propose() == [9, 1, 2, 3, 4]  # up to the end
    assert NgramLookup([5, 6, 7, 8], num_tokens=4).propose() == []
    assert NgramLookup([5, 6, 5, 6], num_tokens=4, min_ngram=3).propose() == []
    assert NgramLookup([7, 5, 8, 5], num_tokens=2, min_ngram=1).propose() == [8, 5]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramLookup([1], num_tokens=0)


def test_lookup_proposal_takes_earliest_longest_ngram_match():
    context = torch.tensor([1, 2, 3, 4, 9, 1, 2, 3])
    assert lookup_proposal(context, max_ngram=4, num_tokens=6).tolist() == [4, 9, 1, 2, 3]
    assert lookup_proposal(context, max_ngram=4, num_tokens=2).tolist() == [4, 9]
    assert lookup_proposal(torch.tensor([5, 6, 7, 8]), max_ngram=4).numel() == 0
    with pytest.raises(ValueError, match="must be >= 1"):
        lookup_proposal(context, max_ngram=0)


def test_lookup_chain_is_the_drafters_greedy_chain(drafter):
    context = torch.tensor([3, 17, 9, 40])
    for n in (1, 7, 25):
        assert lookup_chain(drafter, context, n).tokens.tolist() == greedy_chain(drafter, context, n)


def test_lookup_saves_drafter_calls_on_repetitive_text(drafter):
    """This random drafter's greedy output falls into a cycle; once the cycle is in context, lookup predicts it."""
    prompt = torch.tensor([3, 17, 9, 40])
    context = torch.cat([prompt, torch.tensor(greedy_chain(drafter, prompt, 40))])
    draft = lookup_chain(drafter, context, 25)
    assert draft.tokens.tolist() == greedy_chain(drafter, context, 25)
    assert draft.accepted > 0 and draft.drafter_calls < 24  # sequential drafting needs 24 steps


def test_lookup_chain_needs_a_snapshot_row(drafter):
    context = torch.tensor([3, 17])
    state = drafter.allocate_state(1)
    logits, _ = drafter.prefill(context.view(1, -1), state=state)
    with pytest.raises(ValueError, match="at least 2 rows"):
        draft_chain_with_lookup(drafter, state, logits[0], context, 5)
