"""A decoupled run's target ranks: the frozen target, serving features to the drafter ranks.

A target rank reads the same plan as the drafter ranks, builds the micro-batches the layout
assigns to it (:func:`schedule`) and sends each one's features to its drafter rank, keeping at
most ``train.feature_prefetch`` sends per drafter rank unfinished. The time spent blocked on
those sends is the target's idle time. Target ranks that shard the target run one forward per
round in lockstep, a padding forward where the round has no micro-batch for them. It holds no
trainable state: a resumed run tells it where the drafter ranks start (:func:`start_point`).

Which target rank computes a micro-batch is fixed by
:meth:`dflash.train.distributed.ranks.RankLayout.source`; both sides derive the shapes from
the plan rows, so only the features travel, with no header. Both ends hold the features on
their own device and NCCL moves device buffers itself (gloo, CPU tensors), so nothing is
staged in host memory and nothing needs pinning. The drafter side is
:mod:`dflash.features.sources.decoupled`.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.batching.io import Row, epoch_path, read_plan_meta, read_rank_plan
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.features.prefetch import epoch_micro_batches
from dflash.features.source import balance
from dflash.features.target_forward import (
    feature_dtype,
    micro_batch_features,
    sliding_windows,
    target_features,
)
from dflash.model.drafter import drafter_autocast
from dflash.model.load import load_target
from dflash.model.objective import objective_of
from dflash.train import simulated
from dflash.train.batches import build_micro_batch, micro_batch_options
from dflash.train.distributed.parallel import load_sharded_target
from dflash.train.distributed.process_group import Dist
from dflash.train.distributed.ranks import RankLayout
from dflash.train.init_drafter import tapped_layers
from dflash.train.observe.pilot import epoch_limits
from dflash.train.run_files import TrainFiles

TIMEOUT = timedelta(seconds=600)
"""How long a rank waits on its peer before the job fails naming it (the process group's)."""

ROW = ("input_ids", "document_ids", "position_ids", "loss_mask")
"""The integer tensors of the simulated-τ row, sent in this order before its features."""


class TopologyError(RuntimeError):
    """A peer rank stopped sending or taking features: the run cannot go on."""


def schedule(
    layout: RankLayout, rank: int, rank_steps: list[list[list[list[Row]]]], first_step: int
) -> list[tuple[int, int, list[Row]] | None]:
    """``(drafter rank, index, rows)`` that target ``rank`` computes in an epoch, one per round,
    in the order it sends them: the drafter ranks' consumption order, so a bounded number in
    flight never deadlocks. A round holds the next ``target_ranks`` micro-batches, so ranks in
    lockstep never wait on a later round either; with a sharded target every target rank gets
    one entry per round, None where the round has no micro-batch for it (at the epoch's first
    and last rounds)."""
    work = {
        layout.position(drafter, index): (drafter, index, rows)
        for drafter, steps in enumerate(rank_steps)
        for index, rows in epoch_micro_batches(steps, first_step)
    }
    if not work:
        return []
    n, mine = layout.target_ranks, rank - layout.drafter_ranks
    rounds = [work.get(r * n + mine) for r in range(min(work) // n, max(work) // n + 1)]
    return rounds if layout.sharded_target else [w for w in rounds if w is not None]


def wait(work: dist.Work, layout: RankLayout, peer: int, what: str) -> None:
    """Wait for a point-to-point message; a dead or stuck peer becomes an error naming it."""
    try:
        ok = work.wait(TIMEOUT)
    except RuntimeError as err:
        raise TopologyError(f"{layout.describe(peer)} failed {what}: {err}") from err
    if ok is False:
        raise TopologyError(f"{layout.describe(peer)} timed out {what} after {TIMEOUT}")


def start_point(world: Dist, epoch: int, step: int) -> tuple[int, int]:
    """Drafter rank 0's resume point, on every rank of the job (collective)."""
    point = torch.tensor([epoch, step], dtype=torch.int64, device=world.device)
    dist.broadcast(point, src=0)
    return int(point[0]), int(point[1])


class BoundedSender:
    """Sends features, at most ``limit`` unfinished per drafter rank; times the blocking."""

    def __init__(self, layout: RankLayout, limit: int) -> None:
        self.layout, self.limit = layout, limit
        self.pending = {d: deque() for d in range(layout.drafter_ranks)}
        self.idle_s = 0.0

    def send(self, features: torch.Tensor, drafter: int, index: int) -> None:
        if len(self.pending[drafter]) >= self.limit:
            self._finish_oldest(drafter)
        self.pending[drafter].append((index, features, dist.isend(features, dst=drafter)))

    def _finish_oldest(self, drafter: int) -> None:
        index, _, work = self.pending[drafter].popleft()
        began = time.perf_counter()
        wait(work, self.layout, drafter, f"to take micro-batch {index}")
        self.idle_s += time.perf_counter() - began

    def drain(self) -> None:
        for drafter, queue in self.pending.items():
            while queue:
                self._finish_oldest(drafter)


def send_row(row: dict[str, torch.Tensor] | None, layout: RankLayout, device) -> None:
    """The simulated-τ row to every drafter rank: its length (0: none), then its tensors."""
    length = 0 if row is None else row["input_ids"].shape[1]
    for drafter in range(layout.drafter_ranks):
        header = torch.tensor([length], dtype=torch.int64, device=device)
        tensors = [header] + ([] if row is None else [row[k] for k in ROW] + [row["features"]])
        works = [dist.isend(t.contiguous(), dst=drafter) for t in tensors]
        for work in works:
            wait(work, layout, drafter, "to take the simulated-τ row")


def receive_row(layout: RankLayout, width: int, dtype: torch.dtype, device) -> dict | None:
    """The row :func:`send_row` sends, on a drafter rank."""
    source = layout.drafter_ranks
    header = torch.zeros(1, dtype=torch.int64, device=device)
    wait(dist.irecv(header, src=source), layout, source, "to send the simulated-τ row")
    length = int(header[0])
    if length == 0:
        return None
    row = {k: torch.empty((1, length), dtype=torch.int64, device=device) for k in ROW}
    row["features"] = torch.empty((1, length, width), dtype=dtype, device=device)
    works = [dist.irecv(row[k], src=source) for k in (*ROW, "features")]
    for work in works:
        wait(work, layout, source, "to send the simulated-τ row")
    return row


def serve(config: Config, files: TrainFiles, ctx: Dist, layout: RankLayout) -> None:
    """Run a target rank from the drafter ranks' start point to the end of the last epoch.

    ``ctx`` is the target ranks' group when they shard the target
    (:func:`dflash.features.sources.decoupled.place`); every target rank then runs the same
    forwards, the held-out batch's included, so that their all-gathers pair up.
    """
    target = served_target(files.target, ctx, layout)
    t = config.train
    layer_ids = tapped_layers(config.drafter, files.init, target.config.num_hidden_layers)
    dtype, autocast = feature_dtype(target), drafter_autocast(ctx.device)
    distills = objective_of(config).distills
    if ctx.rank == layout.drafter_ranks or layout.sharded_target:
        tokenizer = load_tokenizer(files.tokenizer)
        options = dict(config.data.chat_template_kwargs)
        row = simulated.heldout_row(
            files.heldout, target, tokenizer, layer_ids, config.data.max_seq_len, autocast, options
        )
        if ctx.rank == layout.drafter_ranks:
            send_row(row, layout, ctx.device)
    first_epoch, first_step = start_point(ctx, 0, 0)
    began = time.perf_counter()
    store, sender = TokenStore(files.tokenized), BoundedSender(layout, t.feature_prefetch)
    options = micro_batch_options(config, sliding_windows(target))
    planned = [e["n_steps"] for e in read_plan_meta(files.plans)["epochs"]][: t.epochs]
    limits = epoch_limits(planned, t.max_steps)  # a pilot's drafter ranks stop there too
    for epoch in range(first_epoch, t.epochs):
        path = epoch_path(files.plans, epoch)
        rank_steps = [read_rank_plan(path, r)[: limits[epoch]] for r in range(layout.drafter_ranks)]
        first = first_step if epoch == first_epoch else 0
        for work in schedule(layout, ctx.rank, rank_steps, first):
            if work is None:
                with torch.inference_mode(), autocast:
                    padding_forward(target, layer_ids, ctx.device)
                continue
            drafter, index, rows = work
            mb = build_micro_batch(store, rows, epoch=epoch, **options).to(ctx.device)
            with torch.inference_mode(), autocast:
                features = micro_batch_features(target, layer_ids, mb, distills)
            sender.send(features.to(dtype).contiguous(), drafter, index)
    sender.drain()
    busy = time.perf_counter() - began - sender.idle_s
    balance(ctx, sender.idle_s, busy, "target")


def served_target(path: Path, ctx: Dist, layout: RankLayout) -> torch.nn.Module:
    """The target whole on this rank's device, or this rank's FSDP shards of it."""
    if layout.sharded_target:
        return load_sharded_target(path, ctx)
    return load_target(path, device=ctx.device)


def padding_forward(target: torch.nn.Module, layer_ids: list[int], device: torch.device) -> None:
    """A one-token forward whose features are dropped: the round's forward of a sharded
    target rank that has no micro-batch in it, so the target ranks' all-gathers pair up."""
    one = torch.zeros((1, 1), dtype=torch.int64, device=device)
    target_features(target, one, one, one, layer_ids)
