"""Check every invariant of a plan on disk; stop at the first violation, naming it.

Used by ``python -m dflash.batching.planner validate`` and by the tests, so the contract is
written once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.batching import io
from dflash.batching.cost import BY_PADDED_TOKENS, CostModel
from dflash.batching.errors import BatchingError, InvalidPlanError
from dflash.batching.metrics import Structure, epoch_metrics, structure
from dflash.batching.registry import strategy
from dflash.batching.strategy import Strategy

FIGURE_TOLERANCE = 1e-9


def validate_plans(plans_dir: str | Path, lengths: np.ndarray) -> dict[str, Any]:
    """Raise ``InvalidPlanError`` at the first broken invariant; return the summary if none."""
    summary = io.read_plan_meta(plans_dir)
    meta = summary.get("meta")
    _require(isinstance(meta, dict), "summary.json has no 'meta' object")
    _require(
        meta["lengths_sha256"] == io.lengths_fingerprint(lengths)
        and meta["n_samples"] == lengths.size,
        "the plan was made from other lengths (lengths_sha256 / n_samples differ)",
    )
    _require(
        len(summary["epochs"]) == meta["epochs"],
        f"summary lists {len(summary['epochs'])} epochs, meta says {meta['epochs']}",
    )
    made_by = _strategy(meta)
    previous = None
    cost = CostModel(**meta["cost"]) if "cost" in meta else BY_PADDED_TOKENS
    for epoch in range(meta["epochs"]):
        path = io.epoch_path(plans_dir, epoch)
        _require(path.exists(), f"{path} is missing")
        table, file_meta = io.read_epoch(path)
        _require(file_meta == meta, f"{path}: its meta differs from summary.json's")
        check_epoch(table, lengths, meta, epoch)
        figures, previous = epoch_metrics(table, lengths.size, previous, cost)
        _check_figures(figures, summary["epochs"][epoch], f"epoch {epoch}")
        _require(
            not (made_by.frozen and epoch > 0) or figures["frozen_batch_fraction"] == 1.0,
            f"epoch {epoch}: '{made_by.name}' must keep every micro-batch of the previous epoch",
        )
    return summary


def check_epoch(table: pa.Table, lengths: np.ndarray, meta: dict[str, Any], epoch: int) -> None:
    """The invariants of one epoch table against the lengths and the plan's meta: its columns,
    then its samples, slots, rows and the strategy's limits; the first broken one raises."""
    where = f"epoch {epoch}"
    made_by = _strategy(meta)
    _require(
        table.schema.remove_metadata().equals(io.SCHEMA),
        f"{where}: schema {table.schema} differs from {io.SCHEMA}",
    )
    col = {name: table.column(name).to_numpy() for name in table.column_names}
    _require(bool(np.all(col["epoch"] == epoch)), f"{where}: column 'epoch' is not {epoch}")
    _check_samples(col, lengths, where)
    s = structure(table)
    _check_slots(col, s, meta, where)
    _check_rows(col, s, lengths.size, made_by, where)
    _check_limits(col, s, meta, made_by, where)


def _check_samples(col: dict[str, np.ndarray], lengths: np.ndarray, where: str) -> None:
    """Every sample placed exactly once, with its length, in plan order."""
    n = lengths.size
    ids = col["sample_id"]
    _require(bool(np.all((ids >= 0) & (ids < n))), f"{where}: a sample_id is outside 0..{n - 1}")
    counts = np.bincount(ids, minlength=n)
    _first(counts != 1, lambda i: f"{where}: sample {i} is placed {counts[i]} times, not once")
    _first(
        col["length"] != lengths[ids],
        lambda i: (
            f"{where}: sample {ids[i]} has length {col['length'][i]}, "
            f"the lengths file says {lengths[ids[i]]}"
        ),
    )
    _check_order(col, where)


def _check_slots(
    col: dict[str, np.ndarray], s: Structure, meta: dict[str, Any], where: str
) -> None:
    """Every (step, rank, micro) slot holds one micro-batch, and the last step is whole."""
    world, accum = meta["world_size"], meta["grad_accum"]
    _require(
        bool(np.all(col["rank"] < world) and np.all(col["micro"] < accum)),
        f"{where}: a rank >= world_size = {world} or a micro >= grad_accum = {accum}",
    )
    mb_starts = np.flatnonzero(np.diff(s.mb_id, prepend=-1))
    slots = (col["step"][mb_starts] * world + col["rank"][mb_starts]) * accum
    slots += col["micro"][mb_starts]
    _first(
        slots != np.arange(slots.size),
        lambda i: (
            f"{where}: micro-batch slot {i} (step {i // (world * accum)}, rank "
            f"{i // accum % world}, micro {i % accum}) is missing"
        ),
    )
    _require(slots.size % (world * accum) == 0, f"{where}: the last step is incomplete")


def _check_rows(
    col: dict[str, np.ndarray], s: Structure, n: int, made_by: Strategy, where: str
) -> None:
    """Rows numbered from 0 in each micro-batch, each sample at the tokens before it in its
    row; one sample a row unless the strategy packs rows. ``n``: the samples."""
    ids = col["sample_id"]
    row_mb = s.mb_id[s.row_starts]
    first_row = np.flatnonzero(np.diff(row_mb, prepend=-1))
    expected_row = np.arange(s.row_starts.size) - first_row[row_mb]
    _first(
        col["row"][s.row_starts] != expected_row,
        lambda i: (
            f"{where}: rows of the micro-batch at step {col['step'][s.row_starts[i]]} "
            "are not numbered 0, 1, 2, ..."
        ),
    )
    lens = col["length"].astype(np.int64)
    before = np.cumsum(lens) - lens
    row_begin = np.zeros(n, dtype=bool)
    row_begin[s.row_starts] = True
    row_of = np.cumsum(row_begin) - 1
    _first(
        col["offset"] != before - before[s.row_starts][row_of],
        lambda i: (
            f"{where}: sample {ids[i]} has offset {col['offset'][i]}, not the tokens "
            "before it in its row"
        ),
    )
    _require(
        made_by.packs_rows or s.row_starts.size == n,
        f"{where}: '{made_by.name}' rows hold one sample",
    )


def _check_limits(
    col: dict[str, np.ndarray], s: Structure, meta: dict[str, Any], made_by: Strategy, where: str
) -> None:
    """No sample over ``max_seq_len``, no micro-batch over ``max_batch_size`` rows or the
    token budget, and no micro-batch mixing buckets when the strategy buckets."""
    ids = col["sample_id"]
    _first(
        col["length"] > meta["max_seq_len"],
        lambda i: f"{where}: sample {ids[i]} has {col['length'][i]} tokens > max_seq_len",
    )
    _first(
        s.mb_rows > meta["max_batch_size"],
        lambda i: f"{where}: micro-batch {i} has {s.mb_rows[i]} rows > max_batch_size",
    )
    _first(
        s.padded > meta["token_budget"],
        lambda i: f"{where}: micro-batch {i} pads to {s.padded[i]} tokens > token_budget",
    )
    if made_by.uses_buckets:
        bucket = np.searchsorted(np.asarray(meta["boundaries"]), col["length"], side="left")
        _first(
            (np.diff(bucket) != 0) & (np.diff(s.mb_id) == 0),
            lambda i: f"{where}: micro-batch {s.mb_id[i]} mixes length buckets",
        )


def _strategy(meta: dict[str, Any]) -> Strategy:
    """The strategy that made the plan, whose expectations the plan must meet."""
    try:
        return strategy(meta["strategy"])
    except BatchingError as err:
        raise InvalidPlanError(f"the plan's {err}") from None


def _check_order(col: dict[str, np.ndarray], where: str) -> None:
    """Rows strictly increase in (step, rank, micro, row, offset): the plan order."""
    ahead = np.zeros(col["step"].size - 1, dtype=bool)
    decided = np.zeros_like(ahead)
    for name in ("step", "rank", "micro", "row", "offset"):
        d = np.diff(col[name].astype(np.int64))
        ahead |= ~decided & (d > 0)
        decided |= d != 0
    _first(~ahead, lambda i: f"{where}: table row {i + 1} is not after row {i} in plan order")


def _check_figures(actual: dict[str, Any], written: dict[str, Any], where: str) -> None:
    for key, value in actual.items():
        stored = written.get(key)
        same = (value is None and stored is None) or (
            value is not None
            and stored is not None
            and math.isclose(value, stored, rel_tol=FIGURE_TOLERANCE, abs_tol=FIGURE_TOLERANCE)
        )
        _require(same, f"{where}: summary says {key} = {stored}, the plan gives {value}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidPlanError(message)


def _first(bad: np.ndarray, message) -> None:
    """Raise with ``message(i)`` for the first ``i`` where ``bad`` holds."""
    hits = np.flatnonzero(bad)
    if hits.size:
        raise InvalidPlanError(message(int(hits[0])))
