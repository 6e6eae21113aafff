"""Plan files on disk: one Parquet per epoch plus ``summary.json``, and the trainer's readers.

Every epoch file carries the plan's ``meta`` as Parquet key-value metadata, the same object as
in ``summary.json``, so a trainer can refuse a plan made from other data or other params.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash.batching.errors import InvalidPlanError
from dflash.fileio import atomic_path, write_json_atomic
from dflash.metrics.schema import PlanSummary
from dflash.pipeline.fingerprint import digest

META_KEY = b"dflash.plan.meta"

SCHEMA = pa.schema(
    [
        ("epoch", pa.int32()),
        ("step", pa.int32()),
        ("rank", pa.int32()),
        ("micro", pa.int32()),
        ("row", pa.int32()),
        ("offset", pa.int32()),
        ("sample_id", pa.int64()),
        ("length", pa.int32()),
    ]
)

Row = list[tuple[int, int, int]]
"""The documents of one row: ``(sample_id, offset in the row, length)``."""
BatchRows = list[Row]
"""The rows of one micro-batch, as the plan holds them."""
Step = list[BatchRows]
"""One optimizer step of one rank: ``grad_accum`` micro-batches."""

PLAN_EPOCH = "epoch_{epoch:03d}.parquet"
PLAN_EPOCH_GLOB = "epoch_*.parquet"
PLAN_SUMMARY = "summary.json"


def epoch_path(plans_dir: str | Path, epoch: int) -> Path:
    return Path(plans_dir) / PLAN_EPOCH.format(epoch=epoch)


def lengths_fingerprint(lengths: np.ndarray) -> str:
    """SHA-256 of the lengths as little-endian int32: identifies the data a plan was made from."""
    return digest(np.ascontiguousarray(lengths, dtype="<i4").tobytes())


def write_epoch(table: pa.Table, path: str | Path, meta: dict[str, Any]) -> None:
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_epoch(path: str | Path) -> tuple[pa.Table, dict[str, Any] | None]:
    """The whole epoch table and its ``meta`` (None when the file has none)."""
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(META_KEY)
    return table.replace_schema_metadata(None), json.loads(raw) if raw else None


def write_summary(summary: dict[str, Any], plans_dir: str | Path) -> None:
    write_json_atomic(Path(plans_dir) / PLAN_SUMMARY, PlanSummary.model_validate(summary).dump())


def read_plan_meta(plans_dir: str | Path) -> dict[str, Any]:
    """``summary.json`` as a dict: ``meta``, per-epoch figures under ``epochs``, overall figures."""
    path = Path(plans_dir) / PLAN_SUMMARY
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `dflash plan` first")
    return json.loads(path.read_text())


def read_rank_plan(path: str | Path, rank: int) -> list[Step]:
    """The steps of one rank, in plan order; reads only that rank's rows.

    ``steps[s][m][r]`` is row ``r`` of micro-batch ``m`` of step ``s``: a list of
    ``(sample_id, offset, length)``, one tuple per document (several only when packed).
    """
    columns = ["step", "micro", "row", "sample_id", "offset", "length"]
    table = pq.read_table(path, columns=columns, filters=[("rank", "=", rank)])
    if table.num_rows == 0:
        raise InvalidPlanError(
            f"{path} has no rows for rank {rank}: was it planned for fewer ranks?"
        )
    steps: list[Step] = []
    last = (-1, -1, -1)
    for step, micro, row, sample_id, offset, length in zip(
        *(table.column(c).to_pylist() for c in columns), strict=True
    ):
        if step != last[0]:
            if step != len(steps):
                raise InvalidPlanError(
                    f"{path}: rank {rank} has no micro-batch in step {len(steps)}"
                )
            steps.append([])
        if (step, micro) != last[:2]:
            steps[-1].append([])
        if (step, micro, row) != last:
            steps[-1][-1].append([])
        steps[-1][-1][-1].append((sample_id, offset, length))
        last = (step, micro, row)
    return steps
