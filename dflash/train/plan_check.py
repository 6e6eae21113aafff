"""Refuse a plan that does not describe this run: other data, other world size, other params.

Training on a stale plan would silently skip or repeat samples, so every difference is named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from dflash.batching.errors import InvalidPlanError
from dflash.batching.io import META_KEY, PLAN_SUMMARY, lengths_fingerprint
from dflash.config.schema import Config
from dflash.data.store import TokenStore


def check_plan(
    plan: dict[str, Any], store: TokenStore, config: Config, world_size: int, plans: Path
) -> None:
    """Raise naming every way ``plan``, read from the directory ``plans``, is not this run's."""
    meta = plan["meta"]
    expected = {
        "lengths_sha256": lengths_fingerprint(store.lengths),
        "n_samples": len(store),
        "world_size": config.train.world_size,
        "grad_accum": config.train.grad_accum,
        "strategy": config.batching.strategy,
        "token_budget": config.batching.token_budget,
        "max_batch_size": config.batching.max_batch_size,
        "max_seq_len": config.data.max_seq_len,
        "seed": config.batching.seed,
    }
    problems = [
        f"{key}: plan has {meta.get(key)!r}, this run needs {value!r}"
        for key, value in expected.items()
        if meta.get(key) != value
    ]
    if world_size != config.train.world_size:
        problems.append(
            f"launched with {world_size} processes but train.world_size = {config.train.world_size}"
        )
    if meta.get("epochs", 0) < config.train.epochs:
        problems.append(
            f"plan covers {meta.get('epochs')} epochs, train.epochs = {config.train.epochs}"
        )
    if problems:
        hint = "the token store changed" if "lengths_sha256" in problems[0] else "params changed"
        raise InvalidPlanError(
            f"stale plan in {plans} ({hint}); rerun `dvc repro plan` (or `dflash plan`):\n  "
            + "\n  ".join(problems)
        )


def check_epoch_file(path: Path, plan: dict[str, Any], epoch: int) -> None:
    """The epoch file must come from the same planning run as ``summary.json``.

    A plan interrupted half-way would otherwise leave new epoch files under an old summary.
    """
    if not path.exists():
        raise InvalidPlanError(f"{path} is missing: rerun `dvc repro plan` (or `dflash plan`)")
    raw = (pq.read_schema(path).metadata or {}).get(META_KEY)
    if raw is None or json.loads(raw) != plan["meta"]:
        raise InvalidPlanError(
            f"{path} was not planned with {path.parent / PLAN_SUMMARY} (epoch {epoch}): "
            "rerun `dvc repro plan` (or `dflash plan`)"
        )
