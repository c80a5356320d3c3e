"""The equality checker flags any corrupted output and locates the first divergence."""
from __future__ import annotations

import pytest

from mamba_draft.benchmarks.equality import compare_outputs
from tree_search.divergence import divergence


def test_identical_outputs_pass():
    refs = [[1, 2, 3], [4, 5]]
    eq = compare_outputs(refs, [list(r) for r in refs])
    assert eq.identical and eq.n_identical == 2 and eq.divergence == [None, None] and eq.prefix_agreement == 1.0
    assert eq.summary().startswith("identical")


def test_corrupted_token_is_flagged_with_position():
    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    corrupted = [[1, 2, 3, 4], [5, 6, 99, 8]]
    eq = compare_outputs(refs, corrupted)
    assert not eq.identical and eq.n_identical == 1
    assert eq.divergence == [None, 2]
    assert eq.prefix_agreement == pytest.approx((1.0 + 0.5) / 2)
    assert "prompt 1 diverges at token 2" in eq.summary()


def test_truncated_or_extended_output_is_flagged():
    assert divergence([1, 2, 3], [1, 2]).first_divergence == 2
    assert divergence([1, 2], [1, 2, 3]).first_divergence == 2
    assert not compare_outputs([[1, 2, 3]], [[1, 2]]).identical


def test_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="1 outputs for 2 reference outputs"):
        compare_outputs([[1], [2]], [[1]])
