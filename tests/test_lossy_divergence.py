"""Divergence of a lossy output from the lossless greedy output (benchmark reporting helper)."""
from __future__ import annotations

import math

import pytest

from tree_search.divergence import divergence, summarize


def test_divergence_positions_and_fractions():
    same = divergence([1, 2, 3], [1, 2, 3])
    assert same.identical and same.first_divergence is None and same.differing_fraction == 0.0
    swapped = divergence([1, 2, 3, 4], [1, 9, 3, 4])
    assert swapped.first_divergence == 1 and swapped.differing_fraction == 0.25
    shorter = divergence([1, 2, 3, 4], [1, 2])
    assert shorter.first_divergence == 2 and shorter.differing_fraction == 0.5
    assert divergence([], []).identical


def test_summarize():
    stats = summarize([divergence([1, 2], [1, 2]), divergence([1, 2, 3, 4], [1, 2, 0, 0])])
    assert stats["identical_fraction"] == 0.5 and stats["mean_first_divergence"] == 2.0
    assert stats["mean_differing_fraction"] == 0.25
    assert math.isnan(summarize([divergence([1], [1])])["mean_first_divergence"])
    with pytest.raises(ValueError, match="at least one"):
        summarize([])
