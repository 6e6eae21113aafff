"""``sorted``: longest first, greedy under the budget, the same micro-batches every epoch.

It ignores the generator, so its micro-batches are frozen across epochs, as in classic
length-sorted batching (fairseq's ``batch_by_size``); only their order (dealt by the planner)
changes.
"""

from __future__ import annotations

import numpy as np

from dflash.batching.layout import BatchLayout, one_sample_rows
from dflash.batching.params import PlanParams
from dflash.batching.strategy import Strategy


def layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> BatchLayout:
    """The first sample of a micro-batch is its longest; ties keep sample order."""
    order = np.lexsort((np.arange(lengths.size), -lengths.astype(np.int64)))
    return one_sample_rows(order, lengths, params.token_budget, params.max_batch_size)


STRATEGY = Strategy(
    name="sorted",
    layout=layout,
    doc="longest first, greedy under the budget: little padding, the same batches every epoch",
    frozen=True,
)
