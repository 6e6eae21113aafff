"""Where the job's ranks go: each trains the drafter, or serves the target to those that do.

A feature source may split the job (:attr:`dflash.features.source.Kind.place`): a decoupled
run gives the target ranks of its own (:mod:`dflash.features.sources.decoupled`). A rank that
trains gets the process group of the ranks that train; a rank that serves runs its ``serve``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dflash.config.schema import Config, TrainConfig
from dflash.train.distributed.process_group import Dist
from dflash.train.distributed.ranks import RankLayout
from dflash.train.run_files import TrainFiles


@dataclass(frozen=True)
class Placement:
    """This process's part in the job: ``ctx`` is the Dist it trains or serves with."""

    ctx: Dist
    layout: RankLayout | None = None
    """The drafter and target ranks of a split job; None when every rank trains."""
    serve: Callable[[Config, TrainFiles], None] | None = None
    """What this rank runs instead of training, ``serve(config, files)``: a target rank's
    loop (:func:`dflash.features.target_ranks.serve`)."""


def every_rank_trains(train: TrainConfig, world: Dist) -> Placement:
    return Placement(world)


@contextlib.contextmanager
def naming_role(layout: RankLayout | None, rank: int) -> Iterator[None]:
    """Prefix an error escaping a rank with its rank and role, for torchrun's report."""
    try:
        yield
    except Exception as err:
        if layout is not None:
            err.add_note(f"dflash train: raised on {layout.describe(rank)}; {layout.roles()}")
        raise
