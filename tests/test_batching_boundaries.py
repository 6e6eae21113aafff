"""Bucket boundaries: the DP is the exact optimum and never loses to the baselines."""

from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.batching.boundaries import (
    boundaries_by,
    explicit_boundaries,
    optimal_boundaries,
    predicted_efficiency,
)
from dflash.batching.choices import BOUNDARY_METHODS
from dflash.batching.errors import BatchingError

small_lengths = st.lists(st.integers(1, 40), min_size=1, max_size=14).map(np.array)


def brute_force_efficiency(lengths: np.ndarray, num_buckets: int) -> float:
    """Best predicted efficiency over every choice of at most ``num_buckets`` edges."""
    values = np.unique(lengths).tolist()
    best = 0.0
    for inner in range(min(num_buckets, len(values))):
        for cut in combinations(values[:-1], inner):
            best = max(best, predicted_efficiency(lengths, [*cut, values[-1]]))
    return best


@settings(max_examples=150, deadline=None)
@given(small_lengths, st.integers(1, 5))
def test_optimal_equals_brute_force(lengths, num_buckets):
    edges = optimal_boundaries(lengths, num_buckets)
    assert len(edges) <= num_buckets
    assert edges == sorted(set(edges)) and edges[-1] == lengths.max()
    assert predicted_efficiency(lengths, edges) == pytest.approx(
        brute_force_efficiency(lengths, num_buckets), rel=1e-12
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=400).map(np.array), st.integers(1, 12))
def test_optimal_never_loses_to_other_methods(lengths, num_buckets):
    best = predicted_efficiency(lengths, optimal_boundaries(lengths, num_buckets))
    for method in BOUNDARY_METHODS:
        edges = boundaries_by(method, lengths, num_buckets)
        assert len(edges) <= num_buckets and edges[-1] == lengths.max()
        assert predicted_efficiency(lengths, edges) <= best + 1e-12


def test_quantile_and_token_mass_split_as_named():
    lengths = np.array([1] * 6 + [10] * 3 + [20])
    assert boundaries_by("quantile", lengths, 2) == [1, 20]
    assert boundaries_by("token_mass", lengths, 2) == [10, 20]


def test_one_bucket_per_distinct_length_is_exact():
    lengths = np.array([5, 7, 7, 9])
    assert optimal_boundaries(lengths, 8) == [5, 7, 9]
    assert predicted_efficiency(lengths, [5, 7, 9]) == 1.0


def test_explicit_boundaries_imply_a_last_bucket_and_reject_bad_lists():
    lengths = np.array([10, 50, 300])
    assert explicit_boundaries([64, 128], lengths, max_seq_len=512) == [64, 128, 512]
    assert explicit_boundaries([64, 300], lengths, max_seq_len=512) == [64, 300]
    with pytest.raises(BatchingError, match="strictly increasing"):
        explicit_boundaries([128, 64], lengths, max_seq_len=512)
    with pytest.raises(BatchingError, match="longest sample"):
        predicted_efficiency(lengths, [64, 128])
