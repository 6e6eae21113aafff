"""The four batching strategies (docs/design.md), each a pure function to a ``Layout``.

Each takes the lengths, the plan params and the epoch's generator. Only ``sorted`` ignores
the generator: its micro-batches are frozen across epochs, as in classic length-sorted
batching (fairseq's ``batch_by_size``), and only their order changes.
"""

from __future__ import annotations

import numpy as np

from dflash.batching.errors import BatchingError
from dflash.batching.layout import Layout, greedy_chunks
from dflash.batching.packing import pack_rows
from dflash.batching.params import PlanParams


def sorted_layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> Layout:
    """Longest first, greedy under the budget: the first sample of a micro-batch is its max."""
    order = np.lexsort((np.arange(lengths.size), -lengths.astype(np.int64)))
    return _one_per_row(order, lengths, params)


def shuffle_layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> Layout:
    """A fresh permutation, greedy under the budget with the running maximum."""
    return _one_per_row(rng.permutation(lengths.size), lengths, params)


def bucketed_layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> Layout:
    """Shuffle inside each length bucket, pack greedily per bucket."""
    if params.boundaries is None or params.boundaries[-1] < lengths.max():
        raise BatchingError(
            f"strategy 'bucketed' needs bucket edges up to the longest sample "
            f"({int(lengths.max())} tokens), got {params.boundaries}"
        )
    bucket = np.searchsorted(np.asarray(params.boundaries), lengths, side="left")
    perm = rng.permutation(lengths.size)
    order = perm[np.argsort(bucket[perm], kind="stable")]
    return _one_per_row(order, lengths, params, segment=bucket[order])


def packed_layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> Layout:
    """Several samples per row up to ``token_budget``; rows in random order, then greedy.

    A row as long as the budget makes a packed micro-batch one row without padding (the
    padding-free layout of varlen kernels): rows of ``max_seq_len``, several to a micro-batch,
    would pad each to the fullest one, 3.6% of the default's tokens. Positions restart at
    every sample and attention stays inside it, so no sample sees more than ``max_seq_len``.
    Inside a row samples go longest first, so samples of one length (those cut at
    ``max_seq_len``, say) lie side by side and the target's feature pass reads them in place.
    """
    row_of = pack_rows(lengths, params.token_budget, rng)
    row_pos = rng.permutation(int(row_of.max()) + 1)[row_of]
    order = np.lexsort((rng.random(lengths.size), -lengths.astype(np.int64), row_pos))
    row_begin = np.ones(order.size, dtype=bool)
    row_begin[1:] = row_pos[order][1:] != row_pos[order][:-1]
    row_starts = np.flatnonzero(row_begin)
    row_tokens = np.add.reduceat(lengths[order].astype(np.int64), row_starts)
    mb_begin = np.zeros(order.size, dtype=bool)
    mb_begin[row_starts] = greedy_chunks(row_tokens, params.token_budget, params.max_batch_size)
    return Layout(order, row_begin, mb_begin)


def _one_per_row(
    order: np.ndarray, lengths: np.ndarray, params: PlanParams, segment: np.ndarray | None = None
) -> Layout:
    mb_begin = greedy_chunks(lengths[order], params.token_budget, params.max_batch_size, segment)
    return Layout(order.astype(np.int64), np.ones(order.size, dtype=bool), mb_begin)


STRATEGIES = {
    "sorted": sorted_layout,
    "shuffle": shuffle_layout,
    "bucketed": bucketed_layout,
    "packed": packed_layout,
}
