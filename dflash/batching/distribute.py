"""Deal micro-batches to optimizer steps and data-parallel ranks, then lay out the table.

Micro-batches of similar cost share a step (sorted by cost, chunked by
``world_size × grad_accum``), steps run in random order, and inside a step the micro-batches
are dealt costliest first, each round of ``world_size`` to the ranks with the least cost so
far (LPT). Ranks of a step then carry nearly equal work and none waits. The cost is the
padded tokens, plus the drafter's block slots under a ``CostModel`` (``dflash.batching.cost``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dflash.batching.cost import BY_PADDED_TOKENS, CostModel
from dflash.batching.io import SCHEMA
from dflash.batching.layout import BatchLayout, split_to_multiple


def padded_sizes(layout: BatchLayout, lengths: np.ndarray) -> np.ndarray:
    """Padded tokens of every micro-batch: rows × longest row."""
    row_starts = np.flatnonzero(layout.row_begin)
    row_tokens = np.add.reduceat(lengths[layout.order].astype(np.int64), row_starts)
    first_rows = np.flatnonzero(layout.mb_begin[row_starts])
    n_rows = np.diff(np.append(first_rows, row_starts.size))
    return n_rows * np.maximum.reduceat(row_tokens, first_rows)


def distribute(
    layout: BatchLayout,
    lengths: np.ndarray,
    world_size: int,
    grad_accum: int,
    epoch: int,
    rng: np.random.Generator,
    cost_model: CostModel = BY_PADDED_TOKENS,
) -> pa.Table:
    """The epoch's plan table in plan order (step, rank, micro, row, offset)."""
    per_step = world_size * grad_accum
    layout = split_to_multiple(layout, per_step)
    mb_starts = np.flatnonzero(layout.mb_begin)
    cost = cost_model.of(padded_sizes(layout, lengths), lengths[layout.order], mb_starts)
    n_mb = cost.size
    n_steps = n_mb // per_step

    by_size = np.lexsort((rng.random(n_mb), cost))
    groups = by_size.reshape(n_steps, per_step)[:, ::-1]
    step = np.empty(n_mb, dtype=np.int64)
    step[groups] = rng.permutation(n_steps)[:, None]
    rank = np.empty(n_mb, dtype=np.int64)
    micro = np.empty(n_mb, dtype=np.int64)
    load = np.zeros((n_steps, world_size), dtype=np.float64)
    for g in range(grad_accum):
        dealt = groups[:, g * world_size : (g + 1) * world_size]
        lightest = np.argsort(load, axis=1, kind="stable")
        rank[dealt] = lightest
        micro[dealt] = g
        np.put_along_axis(load, lightest, np.take_along_axis(load, lightest, 1) + cost[dealt], 1)
    slot = (step * world_size + rank) * grad_accum + micro
    return _table(layout, lengths, slot, epoch, world_size, grad_accum)


def _table(
    layout: BatchLayout,
    lengths: np.ndarray,
    mb_slot: np.ndarray,
    epoch: int,
    world_size: int,
    grad_accum: int,
) -> pa.Table:
    """Put micro-batches at their slot (step, rank, micro); derive the row and offset columns."""
    n = layout.order.size
    mb_id = np.cumsum(layout.mb_begin) - 1
    row_id = np.cumsum(layout.row_begin) - 1
    mb_starts = np.flatnonzero(layout.mb_begin)
    row_starts = np.flatnonzero(layout.row_begin)
    sizes = np.diff(np.append(mb_starts, n))

    slot_sizes = np.empty_like(sizes)
    slot_sizes[mb_slot] = sizes
    slot_starts = np.cumsum(slot_sizes) - slot_sizes
    dest = slot_starts[mb_slot[mb_id]] + np.arange(n) - mb_starts[mb_id]

    lens = lengths[layout.order].astype(np.int64)
    before = np.cumsum(lens) - lens
    first_row_of_mb = row_id[mb_starts]
    columns = {
        "slot": mb_slot[mb_id],
        "row": row_id - first_row_of_mb[mb_id],
        "offset": before - before[row_starts][row_id],
        "sample_id": layout.order,
        "length": lens,
    }
    out = {name: np.empty(n, dtype=np.int64) for name in columns}
    for name, values in columns.items():
        out[name][dest] = values
    slot = out.pop("slot")
    return pa.table(
        {
            "epoch": np.full(n, epoch, dtype=np.int32),
            "step": (slot // (world_size * grad_accum)).astype(np.int32),
            "rank": (slot // grad_accum % world_size).astype(np.int32),
            "micro": (slot % grad_accum).astype(np.int32),
            "row": out["row"].astype(np.int32),
            "offset": out["offset"].astype(np.int32),
            "sample_id": out["sample_id"],
            "length": out["length"].astype(np.int32),
        },
        schema=SCHEMA,
    )
