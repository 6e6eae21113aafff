"""Bucket boundaries: equal count, equal token mass, and the exact padding optimum.

Boundaries are inclusive upper edges: bucket ``k`` holds lengths in ``(b[k-1], b[k]]`` and the
last edge covers the longest sample. The cost model pads every sample to its bucket's upper
edge, so ``predicted_efficiency = Σ length / Σ edge(length)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from dflash.batching.choices import BOUNDARY_METHODS
from dflash.batching.errors import BatchingError


def quantile_boundaries(lengths: np.ndarray, num_buckets: int) -> list[int]:
    """Edges at equal sample counts."""
    ordered = np.sort(lengths)
    cuts = -(-np.arange(1, num_buckets + 1) * ordered.size // num_buckets) - 1
    return sorted(set(ordered[cuts].tolist()))


def token_mass_boundaries(lengths: np.ndarray, num_buckets: int) -> list[int]:
    """Edges at equal total tokens, as lhotse estimates its duration bins."""
    ordered = np.sort(lengths)
    mass = np.cumsum(ordered, dtype=np.int64)
    targets = np.arange(1, num_buckets + 1) * mass[-1] / num_buckets
    cuts = np.minimum(np.searchsorted(mass, targets, side="left"), ordered.size - 1)
    return sorted(set(ordered[cuts].tolist()) | {int(ordered[-1])})


def optimal_boundaries(lengths: np.ndarray, num_buckets: int) -> list[int]:
    """Edges minimising padded tokens, exactly, in O(K·D) over the D distinct lengths.

    Optimal buckets are contiguous runs of the sorted distinct lengths, each padded to its
    largest value (Fisher's grouping DP). With ``P`` the prefix counts,
    ``f_k(j) = v[j-1]·P[j] + min_i (f_{k-1}(i) − v[j-1]·P[i])``: a minimum over lines of slope
    ``−P[i]`` queried at increasing ``v``, answered by a monotone convex-hull deque.
    Integer arithmetic throughout, so the optimum is exact.
    """
    values, counts = np.unique(lengths, return_counts=True)
    v = values.tolist()
    prefix = [0, *np.cumsum(counts).tolist()]
    n_distinct = len(v)
    k_max = min(num_buckets, n_distinct)
    cost = [0] + [v[j - 1] * prefix[j] for j in range(1, n_distinct + 1)]
    choices: list[list[int]] = []
    for k in range(2, k_max + 1):
        best = [0] * (n_distinct + 1)
        choice = [0] * (n_distinct + 1)
        hull: deque[tuple[int, int, int]] = deque()
        for j in range(k, n_distinct + 1):
            _add_line(hull, (-prefix[j - 1], cost[j - 1], j - 1))
            x = v[j - 1]
            while len(hull) > 1 and _at(hull[1], x) <= _at(hull[0], x):
                hull.popleft()
            best[j] = x * prefix[j] + _at(hull[0], x)
            choice[j] = hull[0][2]
        cost = best
        choices.append(choice)
    edges, j = [], n_distinct
    for choice in reversed(choices):
        edges.append(v[j - 1])
        j = choice[j]
    edges.append(v[j - 1])
    return edges[::-1]


def _at(line: tuple[int, int, int], x: int) -> int:
    return line[0] * x + line[1]


def _add_line(hull: deque[tuple[int, int, int]], line: tuple[int, int, int]) -> None:
    """Append a line of smaller slope, dropping those it makes useless for min queries."""
    m3, b3, _ = line
    while len(hull) >= 2:
        (m1, b1, _), (m2, b2, _) = hull[-2], hull[-1]
        if (b3 - b1) * (m1 - m2) <= (b2 - b1) * (m1 - m3):
            hull.pop()
        else:
            break
    hull.append(line)


def predicted_efficiency(lengths: np.ndarray, boundaries: Sequence[int]) -> float:
    """Σ length / Σ upper edge of the sample's bucket (the cost model of ``optimal``)."""
    edges = np.asarray(boundaries, dtype=np.int64)
    bucket = np.searchsorted(edges, lengths, side="left")
    if bucket.max() >= edges.size:
        raise BatchingError(
            f"boundaries end at {int(edges[-1])} but the longest sample has {int(lengths.max())} "
            "tokens"
        )
    return float(lengths.sum(dtype=np.int64) / edges[bucket].sum())


def boundaries_by(method: str, lengths: np.ndarray, num_buckets: int) -> list[int]:
    if method not in BOUNDARY_METHODS:
        raise BatchingError(
            f"boundaries method {method!r}: allowed are {', '.join(BOUNDARY_METHODS)}"
        )
    return BY_METHOD[method](lengths, num_buckets)


def explicit_boundaries(edges: Sequence[int], lengths: np.ndarray, max_seq_len: int) -> list[int]:
    """Check a given list; a last bucket up to ``max_seq_len`` is implied if samples exceed it."""
    edges = [int(e) for e in edges]
    if not edges or any(b <= a for a, b in zip(edges, edges[1:], strict=False)) or edges[0] < 1:
        raise BatchingError(f"boundaries {edges}: need positive, strictly increasing edges")
    if edges[-1] < int(lengths.max()):
        edges.append(max_seq_len)
    return edges


BY_METHOD = {method: globals()[f"{method}_boundaries"] for method in BOUNDARY_METHODS}
"""Each method's function, found by its name, so the methods are listed once."""
