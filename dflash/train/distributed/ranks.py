"""Which rank does what in a training job: a pure function of ``train.*``.

The launching process sizes the job and checks the machine with it before torch and the
models are imported; the decoupled feature source (:mod:`dflash.features.sources.decoupled`)
splits the started job by the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config.schema import TrainConfig


def processes(train: TrainConfig) -> int:
    """Ranks in the job: the drafter ranks the plan is made for, plus the target ranks."""
    return train.world_size + (train.target_ranks if train.topology == "decoupled" else 0)


def shards_target(train: TrainConfig) -> bool:
    """Whether the target ranks shard the target among themselves: FSDP, over more than one."""
    return train.topology == "decoupled" and train.parallelism == "fsdp" and train.target_ranks > 1


@dataclass(frozen=True)
class RankLayout:
    drafter_ranks: int
    target_ranks: int
    sharded_target: bool = False
    """The target ranks hold FSDP shards of one target and run its forwards in lockstep."""

    def role(self, rank: int) -> str:
        return "drafter" if rank < self.drafter_ranks else "target"

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.role(rank)})"

    def position(self, drafter: int, index: int) -> int:
        """Place of micro-batch ``index`` (within the epoch) of drafter rank ``drafter`` in the
        order the drafter ranks consume them: by index, then drafter rank (every rank has
        ``grad_accum`` micro-batches a step)."""
        return index * self.drafter_ranks + drafter

    def source(self, drafter: int, index: int) -> int:
        """Global rank of the target rank that computes that micro-batch: dealt in turn in
        consumption order, so each round of ``target_ranks`` consecutive micro-batches gives
        every target rank one."""
        return self.drafter_ranks + self.position(drafter, index) % self.target_ranks

    def roles(self) -> str:
        d, n = self.drafter_ranks, self.target_ranks
        return f"ranks 0-{d - 1} train the drafter, ranks {d}-{d + n - 1} run the target"
