"""Pack samples into rows of a fixed capacity, first-fit-decreasing style, in numpy.

Rows are opened with the longest samples still unplaced, as many as the remaining tokens
need at least; then, round after round, every open row takes the longest remaining sample
that fits its gap (largest gap first, each sample once). Samples that fit nowhere open the
next set of rows. Ties between equal lengths are broken at random, so the composition of
rows changes every epoch while the fill stays near 100%.
"""

from __future__ import annotations

import numpy as np


def pack_rows(lengths: np.ndarray, capacity: int, rng: np.random.Generator) -> np.ndarray:
    """Row id of every sample; rows hold at most ``capacity`` tokens, ids are 0..R-1."""
    pool = np.lexsort((rng.random(lengths.size), lengths))
    pool_len = lengths[pool].astype(np.int64)
    row_of = np.empty(lengths.size, dtype=np.int64)
    n_rows = 0
    while pool.size:
        needed = -(-int(pool_len.sum()) // capacity)
        cannot_share = int(np.count_nonzero(pool_len > capacity // 2))
        opened = min(max(needed, cannot_share), pool.size)
        row_of[pool[-opened:]] = np.arange(n_rows, n_rows + opened)
        gaps = capacity - pool_len[-opened:]
        pool, pool_len = pool[:-opened], pool_len[:-opened]
        while pool.size:
            rows = np.flatnonzero(gaps >= pool_len[0])
            if rows.size == 0:
                break
            rows = rows[np.argsort(-gaps[rows], kind="stable")]
            fit = np.searchsorted(pool_len, gaps[rows], side="right") - 1
            rank = np.arange(rows.size)
            taken = np.minimum.accumulate(fit + rank) - rank
            placed = taken >= 0
            rows, taken = rows[placed], taken[placed]
            row_of[pool[taken]] = n_rows + rows
            gaps[rows] -= pool_len[taken]
            keep = np.ones(pool.size, dtype=bool)
            keep[taken] = False
            pool, pool_len = pool[keep], pool_len[keep]
        n_rows += opened
    return row_of
