"""The stats stage: length statistics of the token store and the bucket boundaries each
method would choose (:mod:`dflash.batching.length_stats`)."""

from __future__ import annotations

import logging

from dflash.batching.length_stats import headline, write_stats
from dflash.batching.lengths import read_lengths
from dflash.batching.params import PlanParams
from dflash.config.schema import Config
from dflash.data.store import STORE_INDEX
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> None:
    b = config.batching
    lengths = read_lengths(workspace.tokenized / STORE_INDEX)
    params = PlanParams(
        strategy="bucketed",
        token_budget=b.token_budget,
        max_seq_len=config.data.max_seq_len,
        max_batch_size=b.max_batch_size,
        seed=b.seed,
    )
    report = write_stats(lengths, b.num_buckets, params, workspace.stats)
    logger.info(headline(report))
