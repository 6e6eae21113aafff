"""Figures of one epoch's plan: padding, rank balance, and how random the batches are.

Definitions: padding efficiency = Σ length / Σ padded; rank imbalance = mean over steps of
(max rank padded / mean rank padded − 1); cost imbalance = the same over each rank's cost
(``dflash.batching.cost``: padded tokens plus the drafter's block slots); frozen batch
fraction = share of micro-batches whose sample set is one of the previous epoch; pair
overlap = share of sample pairs batched together that were together in the previous epoch;
window KS = mean Kolmogorov–Smirnov statistic of each window of 4,096 samples in plan order
against the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.batching.cost import BY_PADDED_TOKENS, CostModel

WINDOW = 4096


@dataclass(frozen=True)
class Structure:
    """The micro-batches of a plan table (rows in plan order)."""

    sample_id: np.ndarray
    length: np.ndarray
    mb_id: np.ndarray
    """micro-batch index of every placement, 0..M-1 in plan order."""
    row_starts: np.ndarray
    row_tokens: np.ndarray
    mb_step: np.ndarray
    mb_rank: np.ndarray
    mb_rows: np.ndarray
    padded: np.ndarray


def structure(table: pa.Table) -> Structure:
    col = {name: table.column(name).to_numpy() for name in table.column_names}
    new_mb = _changes(col["step"], col["rank"], col["micro"])
    new_row = new_mb | _changes(col["row"])
    row_starts = np.flatnonzero(new_row)
    mb_starts = np.flatnonzero(new_mb)
    row_tokens = np.add.reduceat(col["length"].astype(np.int64), row_starts)
    first_rows = np.flatnonzero(new_mb[row_starts])
    mb_rows = np.diff(np.append(first_rows, row_starts.size))
    return Structure(
        sample_id=col["sample_id"],
        length=col["length"],
        mb_id=np.cumsum(new_mb) - 1,
        row_starts=row_starts,
        row_tokens=row_tokens,
        mb_step=col["step"][mb_starts],
        mb_rank=col["rank"][mb_starts],
        mb_rows=mb_rows,
        padded=mb_rows * np.maximum.reduceat(row_tokens, first_rows),
    )


def _changes(*columns: np.ndarray) -> np.ndarray:
    """True where any column differs from the previous position (and at position 0)."""
    changed = np.zeros(columns[0].size, dtype=bool)
    changed[:1] = True
    for c in columns:
        changed[1:] |= c[1:] != c[:-1]
    return changed


def micro_batch_of_sample(s: Structure, n_samples: int) -> np.ndarray:
    out = np.full(n_samples, -1, dtype=np.int64)
    out[s.sample_id] = s.mb_id
    return out


def rank_imbalance(s: Structure, weights: np.ndarray | None = None) -> float:
    """Mean over steps of max/mean load per rank − 1; the load is padded tokens, or ``weights``
    per micro-batch."""
    n_steps, world = int(s.mb_step.max()) + 1, int(s.mb_rank.max()) + 1
    weights = s.padded if weights is None else weights
    load = np.bincount(s.mb_step * world + s.mb_rank, weights=weights, minlength=n_steps * world)
    load = load.reshape(n_steps, world)
    return float(np.mean(load.max(axis=1) / load.mean(axis=1) - 1.0))


def _set_hashes(mb_of_sample: np.ndarray) -> np.ndarray:
    """An order-free 64-bit hash of every micro-batch's sample set (sum of mixed ids)."""
    order = np.argsort(mb_of_sample, kind="stable")
    starts = np.flatnonzero(_changes(mb_of_sample[order]))
    with np.errstate(over="ignore"):
        z = order.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        sizes = np.diff(np.append(starts, order.size)).astype(np.uint64)
        return np.add.reduceat(z, starts) ^ (sizes * np.uint64(0xD6E8FEB86659FD93))


def frozen_batch_fraction(current: np.ndarray, previous: np.ndarray) -> float:
    """Share of micro-batches (given as micro-batch id per sample) also in ``previous``."""
    return float(np.isin(_set_hashes(current), _set_hashes(previous)).mean())


def pair_overlap(current: np.ndarray, previous: np.ndarray) -> float:
    sizes = np.bincount(current).astype(np.int64)
    pairs = int((sizes * (sizes - 1) // 2).sum())
    if pairs == 0:
        return 0.0
    _, kept = np.unique(current * (int(previous.max()) + 1) + previous, return_counts=True)
    return float((kept * (kept - 1) // 2).sum() / pairs)


def window_ks(lengths_in_order: np.ndarray, window: int = WINDOW) -> float:
    """Mean KS distance between each full window and the whole epoch (0 if none is full)."""
    n_windows = lengths_in_order.size // window
    if n_windows == 0:
        return 0.0
    values, code = np.unique(lengths_in_order, return_inverse=True)
    head = code[: n_windows * window]
    counts = np.bincount(
        np.arange(head.size) // window * values.size + head, minlength=n_windows * values.size
    )
    cdf_windows = np.cumsum(counts.reshape(n_windows, values.size), axis=1) / window
    cdf_all = np.cumsum(np.bincount(code, minlength=values.size)) / code.size
    return float(np.abs(cdf_windows - cdf_all).max(axis=1).mean())


def epoch_metrics(
    table: pa.Table,
    n_samples: int,
    previous: np.ndarray | None,
    cost_model: CostModel = BY_PADDED_TOKENS,
) -> tuple[dict[str, Any], np.ndarray]:
    """The epoch's figures, and its micro-batch id per sample for the next epoch's."""
    s = structure(table)
    cost = cost_model.of(s.padded, s.length, np.flatnonzero(np.diff(s.mb_id, prepend=-1)))
    current = micro_batch_of_sample(s, n_samples)
    real, padded = int(s.length.sum(dtype=np.int64)), int(s.padded.sum())
    figures = {
        "epoch": int(table.column("epoch")[0].as_py()),
        "n_steps": int(s.mb_step.max()) + 1,
        "n_micro_batches": int(s.padded.size),
        "n_rows": int(s.row_starts.size),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded,
        "rank_imbalance": rank_imbalance(s),
        "cost_imbalance": rank_imbalance(s, cost),
        "frozen_batch_fraction": None
        if previous is None
        else frozen_batch_fraction(current, previous),
        "pair_overlap": None if previous is None else pair_overlap(current, previous),
        "window_ks": window_ks(s.length),
    }
    return figures, current


def overall(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and step-weighted means over epochs; change figures over epochs ≥ 1 only."""
    real = sum(e["real_tokens"] for e in epochs)
    padded = sum(e["padded_tokens"] for e in epochs)
    steps = sum(e["n_steps"] for e in epochs)
    later = epochs[1:]
    return {
        "n_steps": steps,
        "n_micro_batches": sum(e["n_micro_batches"] for e in epochs),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded,
        "rank_imbalance": sum(e["rank_imbalance"] * e["n_steps"] for e in epochs) / steps,
        "cost_imbalance": sum(e["cost_imbalance"] * e["n_steps"] for e in epochs) / steps,
        "frozen_batch_fraction": _mean([e["frozen_batch_fraction"] for e in later]),
        "pair_overlap": _mean([e["pair_overlap"] for e in later]),
        "window_ks": _mean([e["window_ks"] for e in epochs]),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
