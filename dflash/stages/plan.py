"""The plan stage: every epoch's micro-batches with ``batching.strategy``, scored for padding
and balance (:mod:`dflash.batching.planner`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from dflash.batching.lengths import read_lengths
from dflash.batching.planner import headline, params_from_config, write_plans
from dflash.batching.stats_files import BUCKETS
from dflash.config.schema import Config
from dflash.data.store import STORE_INDEX
from dflash.errors import ConfigError
from dflash.fileio import write_json_atomic
from dflash.metrics.schema import PlanMetrics
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


PLAN_BYTES_PER_SAMPLE = 64
"""A generous bound on a plan row's bytes on disk (eight int columns, before compression)."""


def run(config: Config, workspace: Workspace) -> None:
    w = workspace
    lengths = read_lengths(w.tokenized / STORE_INDEX)
    check_disk(lengths.size, config.train.epochs, w.plans)
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


def check_disk(samples: int, epochs: int, plans: Path) -> None:
    """Refuse, before writing anything, plans that the disk cannot hold."""
    need = samples * epochs * PLAN_BYTES_PER_SAMPLE
    existing = plans if plans.exists() else plans.parent
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if need > free:
        raise ConfigError(
            f"train.epochs = {epochs}: {samples} samples an epoch need up to "
            f"{need / 2**30:.1f} GiB of plans, but {free / 2**30:.1f} GiB are free; at most "
            f"{free // max(samples * PLAN_BYTES_PER_SAMPLE, 1)} epochs fit"
        )
