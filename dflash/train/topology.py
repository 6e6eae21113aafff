"""Decoupled training: target ranks compute the features, drafter ranks train on them.

``train.topology: decoupled`` runs ``train.world_size + train.target_ranks`` processes in one
``torchrun`` job. Global ranks ``[0, world_size)`` train the drafter, exactly as colocated
ranks would, on their own process group and the same plan; ranks ``[world_size, world_size +
target_ranks)`` hold the frozen target only and send each drafter rank the features of its
micro-batches by point-to-point messages (gloo on CPU, NCCL on GPU). Drafter ranks come first
so a drafter rank's global rank is its plan rank: checkpoints, logs and the rank-0 writer are
those of a colocated run, which a decoupled run may resume and the other way round.

Which target rank computes a micro-batch is fixed by :meth:`RankLayout.source`; both sides derive
the shapes from the plan rows, so only the features travel, with no header. At most
``train.feature_prefetch`` micro-batches per drafter rank are in flight. Both ends hold the
features on their own device and NCCL moves device buffers itself (gloo, CPU tensors), so
nothing is staged in host memory here and nothing needs pinning.

Under ``train.parallelism: fsdp`` with more than one target rank, the target ranks shard the
target among themselves (FSDP2 over their own process group, each loading only its shards).
Its forwards are then collectives, so the target ranks run in lockstep: one forward each per
round of :func:`schedule`, a one-token forward whose features are dropped where a rank has no
micro-batch in a round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.batching.io import Row
from dflash.config.schema import TrainConfig
from dflash.train.batches import MicroBatch
from dflash.train.distributed.process_group import Dist
from dflash.train.distributed.ranks import RankLayout, processes, shards_target
from dflash.train.prefetch import Window, epoch_micro_batches
from dflash.train.step import micro_batch_features

TIMEOUT = timedelta(seconds=600)
"""How long a rank waits on its peer before the job fails naming it (the process group's)."""


class TopologyError(RuntimeError):
    """A peer rank stopped sending or taking features: the run cannot go on."""


def micro_batch_shape(rows: list[Row]) -> tuple[int, int]:
    """``(rows, width)`` of the micro-batch ``dflash.train.batches`` builds from ``rows``."""
    return len(rows), max(sum(length for _, _, length in row) for row in rows)


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


@dataclass(frozen=True)
class Placement:
    """This process's part in the job: ``ctx`` is the Dist it trains or serves with."""

    ctx: Dist
    layout: RankLayout | None
    """None when colocated."""

    @property
    def serves_target(self) -> bool:
        return self.layout is not None and self.layout.role(self.ctx.rank) == "target"


def place(train: TrainConfig, world: Dist) -> Placement:
    """Split the job's ranks by role (collective: every rank calls it).

    A drafter rank's Dist is the drafter ranks' group; a target rank's is the target ranks'
    group when they shard the target, else the whole job.
    """
    if train.topology != "decoupled":
        return Placement(world, None)
    layout = RankLayout(train.world_size, train.target_ranks, shards_target(train))
    if world.world_size != processes(train):
        raise TopologyError(
            f"decoupled training needs train.world_size + train.target_ranks = "
            f"{processes(train)} ranks, torchrun started {world.world_size}"
        )
    d, n = layout.drafter_ranks, layout.target_ranks
    group = dist.new_group(list(range(d)), timeout=TIMEOUT)
    if layout.sharded_target:
        target_group = dist.new_group(list(range(d, d + n)), timeout=TIMEOUT)
    if layout.role(world.rank) == "drafter":
        return Placement(Dist(world.rank, d, world.local_rank, world.device, group), layout)
    if not layout.sharded_target:
        return Placement(world, layout)
    return Placement(Dist(world.rank, n, world.local_rank, world.device, target_group), layout)


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


def fractions(world: Dist, idle_s: float, busy_s: float, role: str) -> dict[str, float]:
    """Target idle and drafter wait fractions over the whole job (collective)."""
    offset = 0 if role == "target" else 2
    sums = torch.zeros(4, dtype=torch.float64)
    sums[offset : offset + 2] = torch.tensor([idle_s, busy_s + idle_s], dtype=torch.float64)
    sums = sums.to(world.device)
    dist.all_reduce(sums)
    sums = sums.cpu()
    return {
        "target_idle_fraction": float(sums[0] / sums[1].clamp(min=1e-9)),
        "drafter_wait_fraction": float(sums[2] / sums[3].clamp(min=1e-9)),
    }


class ColocatedFeatures:
    """The rank's own target computes its features."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int], last: bool = False) -> None:
        self.target, self.layer_ids, self.last = target, layer_ids, last
        self.forwards = 0

    def start(self, epoch: int, step: int) -> None:
        pass

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        pass

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        self.forwards += 1
        return micro_batch_features(self.target, self.layer_ids, mb, self.last)

    def finish(self) -> dict[str, float]:
        return {
            "target_idle_fraction": 0.0,
            "drafter_wait_fraction": 0.0,
            "target_forwards": self.forwards,
        }


class DecoupledFeatures:
    """A drafter rank's features, received from the target ranks in plan order.

    Receives for the next ``prefetch`` micro-batches are posted ahead, so the target ranks
    compute while this rank trains; the time spent waiting on them is the drafter's wait.
    """

    def __init__(
        self, ctx: Dist, layout: RankLayout, width: int, dtype: torch.dtype, prefetch: int
    ) -> None:
        self.ctx, self.layout, self.width, self.dtype = ctx, layout, width, dtype
        self.world = Dist(ctx.rank, layout.drafter_ranks + layout.target_ranks, 0, ctx.device)
        self.window = Window(prefetch, self._post, TopologyError)

    def start(self, epoch: int, step: int) -> None:
        start_point(self.world, epoch, step)
        self.window.restart_clock()

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        self.window.epoch(steps, first_step)

    def _post(self, index: int, rows: list[Row]) -> tuple[int, torch.Tensor, dist.Work]:
        source = self.layout.source(self.ctx.rank, index)
        buffer = torch.empty(
            (*micro_batch_shape(rows), self.width), dtype=self.dtype, device=self.ctx.device
        )
        return source, buffer, dist.irecv(buffer, src=source)

    def _wait(self, index: int, request: tuple[int, torch.Tensor, dist.Work]) -> torch.Tensor:
        source, buffer, work = request
        wait(work, self.layout, source, f"to send micro-batch {index} of drafter rank "
             f"{self.ctx.rank}")  # fmt: skip
        return buffer

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        index, rows, buffer = self.window.take(self._wait)
        if buffer.shape[:2] != mb.input_ids.shape:
            source = self.layout.source(self.ctx.rank, index)
            raise TopologyError(
                f"features of micro-batch {index} from {self.layout.describe(source)} are "
                f"{tuple(buffer.shape)}, the micro-batch is {tuple(mb.input_ids.shape)}"
            )
        return buffer

    def finish(self) -> dict[str, float]:
        w = self.window
        received = {"target_forwards": w.taken}  # one target forward each, on a target rank
        return fractions(self.world, w.wait_s, w.busy_s(), "drafter") | received


def feature_source(
    placement: Placement,
    target: torch.nn.Module,
    layer_ids: list[int],
    prefetch: int,
    last: bool = False,
) -> ColocatedFeatures | DecoupledFeatures:
    """Where a drafter rank's features come from: its own target, or the target ranks (with
    the target's last hidden state after them where ``last``)."""
    if placement.layout is None:
        return ColocatedFeatures(target, layer_ids, last)
    width = (len(layer_ids) + last) * target.config.hidden_size
    dtype = target.get_input_embeddings().weight.dtype
    return DecoupledFeatures(placement.ctx, placement.layout, width, dtype, prefetch)


@contextlib.contextmanager
def naming_role(layout: RankLayout | None, rank: int) -> Iterator[None]:
    """Prefix an error escaping a rank with its rank and role, for torchrun's report."""
    try:
        yield
    except Exception as err:
        if layout is not None:
            err.add_note(f"dflash train: raised on {layout.describe(rank)}; {layout.roles()}")
        raise
