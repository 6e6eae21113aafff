"""How samples sit in micro-batches before they are dealt to steps and ranks.

A ``BatchLayout`` is a sample order plus two boolean marks: where a row begins and where a
micro-batch begins. Rows and micro-batches are contiguous runs of that order, which keeps
every strategy's output a few flat numpy arrays instead of nested Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.batching.errors import TooFewMicroBatchesError


@dataclass(frozen=True)
class BatchLayout:
    order: np.ndarray
    """int64 sample ids, micro-batch by micro-batch, row by row."""
    row_begin: np.ndarray
    """bool per position: a new row starts here."""
    mb_begin: np.ndarray
    """bool per position: a new micro-batch starts here (always also a row start)."""

    @property
    def n_micro_batches(self) -> int:
        return int(np.count_nonzero(self.mb_begin))


def greedy_chunks(
    sizes: np.ndarray, token_budget: int, max_rows: int, segment: np.ndarray | None = None
) -> np.ndarray:
    """Mark where greedy chunks of ``sizes`` (in this order) begin.

    A chunk grows while ``rows × running max ≤ token_budget`` and ``rows ≤ max_rows``: the
    running maximum, not the newest size, so a short item after a long one cannot break the
    budget. Chunks never cross a change of ``segment``. The length a chunk would reach from
    every start is found at once, by binary lifting over maxima of power-of-two spans; only
    the walk from chunk to chunk is a Python loop, one iteration per chunk.
    """
    n = sizes.size
    start = np.arange(n)
    limit = np.minimum(max_rows, n - start)
    if segment is not None:
        run_end = np.flatnonzero(np.append(segment[1:] != segment[:-1], True)) + 1
        limit = np.minimum(limit, run_end[np.searchsorted(run_end, start, side="right")] - start)
    spans = [sizes.astype(np.int64)]
    while 2 ** len(spans) <= limit.max():
        half = 2 ** (len(spans) - 1)
        spans.append(np.maximum(spans[-1], spans[-1][np.minimum(start + half, n - 1)]))
    take = np.zeros(n, dtype=np.int64)
    longest = np.zeros(n, dtype=np.int64)
    for level in reversed(range(len(spans))):
        width = 2**level
        grown = np.maximum(longest, spans[level][np.minimum(start + take, n - 1)])
        fits = (take + width <= limit) & ((take + width) * grown <= token_budget)
        take = np.where(fits, take + width, take)
        longest = np.where(fits, grown, longest)
    begin = np.zeros(n, dtype=bool)
    hops = take.tolist()
    i = 0
    while i < n:
        begin[i] = True
        i += hops[i]
    return begin


def one_sample_rows(
    order: np.ndarray,
    lengths: np.ndarray,
    token_budget: int,
    max_rows: int,
    segment: np.ndarray | None = None,
) -> BatchLayout:
    """One sample per row, in ``order``, cut into greedy micro-batches (``greedy_chunks``)."""
    mb_begin = greedy_chunks(lengths[order], token_budget, max_rows, segment)
    return BatchLayout(order.astype(np.int64), np.ones(order.size, dtype=bool), mb_begin)


def split_to_multiple(layout: BatchLayout, multiple: int) -> BatchLayout:
    """Split the largest micro-batches until their count is a multiple of ``multiple``.

    Splitting only removes samples from a micro-batch, so budgets still hold and nothing is
    dropped. A micro-batch of several rows is cut between rows, a single packed row is cut
    into two rows. The choice depends on sizes only (ties by position), so a frozen
    composition stays frozen.
    """
    n = layout.order.size
    row_begin, mb_begin = layout.row_begin.copy(), layout.mb_begin.copy()
    while True:
        mb_starts = np.flatnonzero(mb_begin)
        need = -mb_starts.size % multiple
        if need == 0:
            return BatchLayout(layout.order, row_begin, mb_begin)
        if mb_starts.size + need > n:
            raise TooFewMicroBatchesError(
                f"{n} samples make {mb_starts.size} micro-batches; world_size × grad_accum = "
                f"{multiple} needs a multiple of it ({mb_starts.size + need}) with at least one "
                "sample each: lower train.world_size or train.grad_accum, or add data"
            )
        sizes = np.diff(np.append(mb_starts, n))
        chosen = np.argsort(-sizes, kind="stable")[:need]
        chosen = chosen[sizes[chosen] >= 2]
        first, stop = mb_starts[chosen], mb_starts[chosen] + sizes[chosen]
        row_starts = np.flatnonzero(row_begin)
        r0 = np.searchsorted(row_starts, first)
        n_rows = np.searchsorted(row_starts, stop) - r0
        cut = np.where(
            n_rows >= 2,
            row_starts[r0 + n_rows // 2],
            first + sizes[chosen] // 2,
        )
        row_begin[cut] = True
        mb_begin[cut] = True
