"""The plan stage: every epoch's micro-batches with ``batching.strategy``, scored for padding
and balance (:mod:`dflash.batching.planner`)."""

from __future__ import annotations

import logging

from dflash.batching.lengths import read_lengths
from dflash.batching.planner import headline, params_from_config, write_plans
from dflash.batching.stats_files import BUCKETS
from dflash.config import Config
from dflash.data.store import STORE_INDEX
from dflash.fileio import write_json_atomic
from dflash.metrics_schema import PlanMetrics
from dflash.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> None:
    w = workspace
    lengths = read_lengths(w.tokenized / STORE_INDEX)
    summary = write_plans(
        lengths,
        params_from_config(config, lengths, w.stats / BUCKETS),
        config.train.epochs,
        w.plans,
    )
    # The plan's figures as a DVC metrics file (outside ``data/plans``, which is an out).
    figures = {k: v for k, v in summary.items() if k != "meta"}
    write_json_atomic(w.plan_metrics, PlanMetrics.model_validate(figures).dump())
    logger.info(headline(summary))
