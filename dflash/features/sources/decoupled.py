"""``decoupled``: target ranks compute the features, drafter ranks train on them.

``train.topology: decoupled`` runs ``train.world_size + train.target_ranks`` processes in one
``torchrun`` job. Global ranks ``[0, world_size)`` train the drafter, exactly as colocated
ranks would, on their own process group and the same plan; ranks ``[world_size, world_size +
target_ranks)`` hold the frozen target only and send each drafter rank the features of its
micro-batches by point-to-point messages (gloo on CPU, NCCL on GPU;
:mod:`dflash.features.target_ranks`). Drafter ranks come first so a drafter rank's global rank
is its plan rank: checkpoints, logs and the rank-0 writer are those of a colocated run, which a
decoupled run may resume and the other way round.

Under ``train.parallelism: fsdp`` with more than one target rank, the target ranks shard the
target among themselves (FSDP2 over their own process group, each loading only its shards).
Its forwards are then collectives, so the target ranks run in lockstep: one forward each per
round of :func:`dflash.features.target_ranks.schedule`, a one-token forward whose features
are dropped where a rank has no micro-batch in a round.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from dflash.batching.io import Row
from dflash.config.schema import TrainConfig
from dflash.features.prefetch import Window
from dflash.features.source import Inputs, Kind, balance
from dflash.features.target_forward import feature_dtype
from dflash.features.target_ranks import (
    TIMEOUT,
    TopologyError,
    receive_row,
    serve,
    start_point,
    wait,
)
from dflash.model.layer_ids import feature_width
from dflash.train.batches import MicroBatch, micro_batch_shape
from dflash.train.distributed.process_group import Dist
from dflash.train.distributed.ranks import RankLayout, processes, shards_target
from dflash.train.topology import Placement

PARAM = "train.topology"


class DecoupledFeatures:
    """A drafter rank's features, received from the target ranks in plan order.

    Receives for the next ``prefetch`` micro-batches are posted ahead, so the target ranks
    compute while this rank trains; the time spent waiting on them is the drafter's wait.
    """

    def __init__(
        self,
        ctx: Dist,
        layout: RankLayout,
        width: int,
        dtype: torch.dtype,
        prefetch: int,
        heldout_width: int,
    ) -> None:
        self.ctx, self.layout, self.width, self.dtype = ctx, layout, width, dtype
        self.heldout_width = heldout_width
        """The held-out batch's features: the tapped layers only, whatever the objective."""
        self.world = Dist(ctx.rank, layout.drafter_ranks + layout.target_ranks, 0, ctx.device)
        self.window = Window(prefetch, self._post, TopologyError)

    def heldout(self) -> dict[str, torch.Tensor] | None:
        """The held-out batch the first target rank answers and sends (features only)."""
        return receive_row(self.layout, self.heldout_width, self.dtype, self.ctx.device)

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
        return balance(self.world, w.wait_s, w.busy_s(), "drafter") | received


def place(train: TrainConfig, world: Dist) -> Placement:
    """Split the job's ranks by role (collective: every rank calls it).

    A drafter rank's Dist is the drafter ranks' group; a target rank's is the target ranks'
    group when they shard the target, else the whole job.
    """
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
    ctx = world
    if layout.sharded_target:
        ctx = Dist(world.rank, n, world.local_rank, world.device, target_group)
    return Placement(ctx, layout, partial(serve, ctx=ctx, layout=layout))


def build(run: Inputs) -> DecoupledFeatures:
    """Features from the target ranks (with the target's last hidden state where ``last``)."""
    hidden, p = run.target.config.hidden_size, run.placement
    return DecoupledFeatures(
        p.ctx, p.layout, feature_width(run.layer_ids, hidden, run.last),
        feature_dtype(run.target), run.config.train.feature_prefetch,
        heldout_width=feature_width(run.layer_ids, hidden),
    )  # fmt: skip


SOURCE = Kind(name="decoupled", build=build, place=place)
