"""``bucketed``: shuffle inside each length bucket, pack greedily per bucket."""

from __future__ import annotations

import numpy as np

from dflash.batching.errors import BatchingError
from dflash.batching.layout import BatchLayout, one_sample_rows
from dflash.batching.params import PlanParams
from dflash.batching.strategy import Strategy


def layout(lengths: np.ndarray, params: PlanParams, rng: np.random.Generator) -> BatchLayout:
    """Buckets are ``params.boundaries`` (inclusive upper edges); no micro-batch spans two."""
    if params.boundaries is None or params.boundaries[-1] < lengths.max():
        raise BatchingError(
            f"strategy 'bucketed' needs bucket edges up to the longest sample "
            f"({int(lengths.max())} tokens), got {params.boundaries}"
        )
    bucket = np.searchsorted(np.asarray(params.boundaries), lengths, side="left")
    perm = rng.permutation(lengths.size)
    order = perm[np.argsort(bucket[perm], kind="stable")]
    return one_sample_rows(
        order, lengths, params.token_budget, params.max_batch_size, segment=bucket[order]
    )


STRATEGY = Strategy(
    name="bucketed",
    layout=layout,
    doc="a random order inside each length bucket (batching.boundaries), greedy per bucket",
    uses_buckets=True,
)
