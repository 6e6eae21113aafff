"""``packed``: several samples per row up to ``token_budget``, rows in random order.

A row as long as the budget makes a packed micro-batch one row without padding (the
padding-free layout of varlen kernels): rows of ``max_seq_len``, several to a micro-batch,
would pad each to the fullest one, 3.6% of the default's tokens. Positions restart at every
sample and attention stays inside it, so no sample sees more than ``max_seq_len``. Inside a
row samples go longest first, so samples of one length (those cut at ``max_seq_len``, say) lie
side by side and the target's feature pass reads them in place.
"""

from __future__ import annotations

import numpy as np

from dflash.batching.layout import BatchLayout, greedy_chunks
from dflash.batching.packing import pack_rows
from dflash.batching.params import PlanParams
from dflash.batching.strategy import Strategy


def layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> BatchLayout:
    """Rows from ``pack_rows``, shuffled, then grouped greedily into micro-batches."""
    row_of = pack_rows(lengths, params.token_budget, rng)
    row_pos = rng.permutation(int(row_of.max()) + 1)[row_of]
    order = np.lexsort((rng.random(lengths.size), -lengths.astype(np.int64), row_pos))
    row_begin = np.ones(order.size, dtype=bool)
    row_begin[1:] = row_pos[order][1:] != row_pos[order][:-1]
    row_starts = np.flatnonzero(row_begin)
    row_tokens = np.add.reduceat(lengths[order].astype(np.int64), row_starts)
    mb_begin = np.zeros(order.size, dtype=bool)
    mb_begin[row_starts] = greedy_chunks(row_tokens, params.token_budget, params.max_batch_size)
    return BatchLayout(order, row_begin, mb_begin)


STRATEGY = Strategy(
    name="packed",
    layout=layout,
    doc="several samples share a row up to token_budget, document-masked: no padding",
    packs_rows=True,
)
