"""``shuffle``: a fresh permutation every epoch, greedy under the budget."""

from __future__ import annotations

import numpy as np

from dflash.batching.layout import BatchLayout, one_sample_rows
from dflash.batching.params import PlanParams
from dflash.batching.strategy import Strategy


def layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> BatchLayout:
    """Padding counts against the running maximum, so a short sample after a long one fits."""
    order = rng.permutation(lengths.size)
    return one_sample_rows(order, lengths, params.token_budget, params.max_batch_size)


STRATEGY = Strategy(
    name="shuffle",
    layout=layout,
    doc="a new random order every epoch, greedy under the budget: random, but it pays padding",
)
