"""The feature source: where a drafter rank gets the target features it trains on.

The drafter is conditioned on hidden states of the frozen target, ``[R, T, width]`` per
micro-batch (:func:`dflash.features.target_forward.target_features`: the tapped layers'
outputs, then the target's last hidden state where the objective distills; zero on padding).
A run asks its source for them in plan order, and the source lives as long as the run:

1. ``heldout()``, once as the run is built: the held-out batch simulated τ is measured on,
   with its features (:func:`dflash.train.simulated.heldout_row`), or None where the source
   has no target to answer the held-out prompts;
2. ``start(epoch, step)``, once, at the point the run starts or resumes from;
3. ``epoch(steps, first_step)`` as each epoch begins, with this rank's planned steps from
   ``first_step`` on: a source that fetches ahead asks for them now;
4. ``source(mb)`` per micro-batch, in plan order, under the step's autocast: its features on
   the rank's device;
5. ``finish()``, once at the end: the balance figures of ``metrics/train.json``
   (:data:`BALANCE`).

Each kind is a module of ``dflash.features.sources`` defining ``SOURCE``, a :class:`Kind`
(:mod:`dflash.features.registry` finds it by the params).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dflash.batching.io import Row
from dflash.config.schema import Config, TrainConfig
from dflash.train.distributed.process_group import Dist
from dflash.train.run_files import TrainFiles
from dflash.train.topology import Placement, every_rank_trains

if TYPE_CHECKING:
    from dflash.train.batches import MicroBatch

BALANCE = ("target_idle_fraction", "drafter_wait_fraction", "target_forwards")
"""What ``finish()`` returns: the share of time the target ranks sat idle and the drafter
waited on features (over the whole job), and the target forwards this rank's features took."""


class FeatureSource(Protocol):
    """A drafter rank's target features, one micro-batch at a time, in plan order."""

    def heldout(self) -> dict[str, torch.Tensor] | None:
        """The held-out τ batch with its features; None where the source has none."""
        ...

    def start(self, epoch: int, step: int) -> None:
        """The run starts (or resumes) at ``step`` of ``epoch``."""
        ...

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        """An epoch begins: this rank's steps (micro-batches of plan rows), from
        ``first_step`` on."""
        ...

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        """``[R, T, width]`` features of the next micro-batch, on the rank's device."""
        ...

    def finish(self) -> dict[str, float]:
        """The run ended: its :data:`BALANCE` figures."""
        ...


@dataclass(frozen=True)
class Inputs:
    """What a source is built from: the run's params, files and place in the job, and the
    target as this rank holds it (whole, or only what the drafter borrows: :attr:`Kind.
    whole_target`)."""

    config: Config
    files: TrainFiles
    placement: Placement
    target: nn.Module
    layer_ids: list[int]
    """The target layers the drafter reads."""
    last: bool
    """Whether the features end with the target's last hidden state (the objective distills)."""
    autocast: AbstractContextManager
    tokenizer: Any


@dataclass(frozen=True)
class Kind:
    """One kind of feature source, named by ``train.topology`` or ``train.features``: its
    module's docstring documents it on the params page."""

    name: str
    build: Callable[[Inputs], FeatureSource]
    whole_target: bool = False
    """Whether a drafter rank holds the whole target (it runs it); else only the embedding
    and LM head the drafter borrows (:func:`dflash.train.borrowed.load_borrowed`)."""
    place: Callable[[TrainConfig, Dist], Placement] = every_rank_trains
    """How the job's ranks split (collective): by default every rank trains the drafter."""


def balance(world: Dist, idle_s: float, busy_s: float, role: str) -> dict[str, float]:
    """Target idle and drafter wait fractions over the whole job (collective): each rank
    gives its idle and busy seconds as a ``role`` rank (``target`` or ``drafter``)."""
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
