"""Micro-batch tensors built from plan rows and the token store, in DataLoader workers.

A plan row lists the documents sharing one row of a micro-batch as ``(sample_id, offset,
length)``; padded rows hold one document at offset 0, packed rows several. Anchors are drawn
here, per document, from a generator seeded by ``(seed, epoch, sample_id)``: re-drawn every
epoch, and the same whatever the world size or the point a run resumed from.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from dflash.batching.errors import InvalidPlanError
from dflash.batching.io import Row
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.heap import skip_exit_collection
from dflash.model.anchors import sample_anchors
from dflash.model.document_layout import DocumentLayout, packing
from dflash.model.labels import LabelPlan, label_plan
from dflash.train.distributed.orphans import die_with_parent


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [R, T] long, 0 on padding
    loss_mask: torch.Tensor  # [R, T] bool
    document_ids: torch.Tensor  # [R, T] long, -1 on padding
    position_ids: torch.Tensor  # [R, T] long, position inside the document
    anchors: torch.Tensor  # [R, A] long, position in the row, -1 = none
    weight_sum: float  # Σ loss weights of this micro-batch, known before the forward
    real_tokens: int
    padded_tokens: int
    n_samples: int
    label_plan: LabelPlan | None = None
    """The objective's labels and mask chunks (``label_plan``); None: the step computes them."""
    layout: DocumentLayout | bool | None = None
    """The feature pass's ``packing``; None: the step computes it."""

    def pin_memory(self) -> MicroBatch:
        return _mapped(self, lambda t: t.pin_memory())

    def to(self, device: torch.device) -> MicroBatch:
        return _mapped(self, lambda t: t.to(device, non_blocking=True))


def _mapped(value, fn):
    """``value`` with ``fn`` applied to every tensor in it, through dataclasses, tuples, lists
    and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _mapped(getattr(value, f.name), fn) for f in fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, (tuple, list)):
        return type(value)(_mapped(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, fn) for k, v in value.items()}
    return value


def micro_batch_options(
    config: Config, windows: tuple[int, ...], flex: bool = False
) -> dict[str, Any]:
    """The keywords of :func:`build_micro_batch` that the params set, beside the target's
    sliding ``windows`` and the drafter's mask (``flex``): the drafter ranks' loader and a
    decoupled run's target ranks build the same micro-batches from them."""
    d = config.drafter
    return dict(
        block_size=d.block_size,
        anchors_per_sequence=d.anchors_per_sequence,
        gamma=d.gamma,
        seed=config.train.seed,
        flex=flex,
        windows=windows,
        position_weight=config.objective.position_weight,
    )


def micro_batch_shape(rows: list[Row]) -> tuple[int, int]:
    """``(rows, width)`` of the micro-batch :func:`build_micro_batch` builds from ``rows``."""
    return len(rows), max(sum(length for _, _, length in row) for row in rows)


def build_micro_batch(
    store: TokenStore,
    rows: list[Row],
    *,
    block_size: int,
    anchors_per_sequence: int,
    gamma: float,
    seed: int,
    epoch: int,
    flex: bool = False,
    windows: tuple[int, ...] = (),
    position_weight: str = "decay",
) -> MicroBatch:
    """The micro-batch of ``rows``, with everything its step would otherwise read back from the
    device: the objective's ``label_plan`` (with the two-part kernel's mask chunks unless the
    drafter attends through FlexAttention, ``flex``) and the feature pass's ``packing`` for
    a target with sliding ``windows``."""
    n_rows, width = micro_batch_shape(rows)
    input_ids = np.zeros((n_rows, width), dtype=np.int64)
    loss_mask = np.zeros((n_rows, width), dtype=bool)
    document_ids = np.full((n_rows, width), -1, dtype=np.int64)
    position_ids = np.zeros((n_rows, width), dtype=np.int64)
    row_anchors: list[np.ndarray] = []
    real_tokens = 0
    for r, row in enumerate(rows):
        anchors = []
        for doc, (sample_id, offset, length) in enumerate(row):
            ids, mask = store[sample_id]
            if len(ids) != length:
                raise InvalidPlanError(
                    f"plan says sample {sample_id} has {length} tokens, the token store has "
                    f"{len(ids)}: the plan was made from other tokenized data"
                )
            span = slice(offset, offset + length)
            input_ids[r, span] = ids
            loss_mask[r, span] = mask.astype(bool)
            document_ids[r, span] = doc
            position_ids[r, span] = np.arange(length)
            rng = np.random.default_rng([seed, epoch, sample_id])
            picked = sample_anchors(mask, block_size, anchors_per_sequence, rng)
            anchors.append(picked + offset)
            real_tokens += length
        row_anchors.append(np.concatenate(anchors) if anchors else np.zeros(0, np.int64))
    n_anchors = max(1, max(len(a) for a in row_anchors))
    anchor_tensor = np.full((n_rows, n_anchors), -1, dtype=np.int64)
    for r, a in enumerate(row_anchors):
        anchor_tensor[r, : len(a)] = a
    loss_mask_t, document_ids_t = torch.from_numpy(loss_mask), torch.from_numpy(document_ids)
    anchors_t = torch.from_numpy(anchor_tensor)
    labels = label_plan(
        loss_mask_t, document_ids_t, anchors_t, block_size, gamma, blocks=not flex,
        position_weight=position_weight,
    )  # fmt: skip
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),
        loss_mask=loss_mask_t,
        document_ids=document_ids_t,
        position_ids=torch.from_numpy(position_ids),
        anchors=anchors_t,
        # The objective's own float32 weights, summed in float64 (exact: they are few bits wide).
        weight_sum=float(labels.weights.double().sum()),
        real_tokens=real_tokens,
        padded_tokens=n_rows * width,
        n_samples=sum(len(row) for row in rows),
        label_plan=labels,
        layout=packing(document_ids_t, windows),
    )


class StepDataset(torch.utils.data.Dataset):
    """Item ``i`` = the ``grad_accum`` micro-batches of this rank's step ``first_step + i``."""

    def __init__(
        self,
        store: TokenStore,
        steps: list[list[list[Row]]],
        *,
        first_step: int,
        epoch: int,
        **build,
    ) -> None:
        """``build``: :class:`StepBuilder`'s keywords (block size, anchors, gamma, seed, ...)."""
        self.steps = steps
        self.first_step = first_step
        self.epoch = epoch
        self.builder = StepBuilder(store, **build)

    def __len__(self) -> int:
        return len(self.steps) - self.first_step

    def __getitem__(self, i: int) -> list[MicroBatch]:
        return self.builder[self.epoch, self.steps[self.first_step + i]]


class StepBuilder(torch.utils.data.Dataset):
    """Item ``(epoch, micro_batches)`` = those planned micro-batches, built for that epoch.

    The key carries the plan rows, so workers that outlive an epoch need no plan of their own:
    :class:`PlannedSteps` hands them each epoch's steps.
    """

    def __init__(
        self,
        store: TokenStore,
        *,
        block_size: int,
        anchors_per_sequence: int,
        gamma: float,
        seed: int,
        flex: bool = False,
        windows: tuple[int, ...] = (),
        position_weight: str = "decay",
    ) -> None:
        self.store = store
        self.kwargs = dict(
            block_size=block_size,
            anchors_per_sequence=anchors_per_sequence,
            gamma=gamma,
            seed=seed,
            flex=flex,
            windows=windows,
            position_weight=position_weight,
        )

    def __getitem__(self, key: tuple[int, list[list[Row]]]) -> list[MicroBatch]:
        epoch, micro_batches = key
        return [
            build_micro_batch(self.store, rows, epoch=epoch, **self.kwargs)
            for rows in micro_batches
        ]


class PlannedSteps(torch.utils.data.Sampler):
    """The keys of :class:`StepBuilder` for this rank's steps of one epoch, in plan order.

    Set per epoch (from the step a resumed run stopped at) in the training process, where the
    DataLoader reads it each time an epoch's iteration starts.
    """

    def __init__(self) -> None:
        self.epoch, self.steps, self.first_step = 0, [], 0

    def set_epoch(self, epoch: int, steps: list[list[list[Row]]], first_step: int) -> None:
        self.epoch, self.steps, self.first_step = epoch, steps, first_step

    def __len__(self) -> int:
        return len(self.steps) - self.first_step

    def __iter__(self) -> Iterator[tuple[int, list[list[Row]]]]:
        for step in self.steps[self.first_step :]:
            yield self.epoch, step


def make_loader(
    dataset: torch.utils.data.Dataset,
    num_workers: int,
    prefetch: int,
    pin_memory: bool,
    sampler: PlannedSteps | None = None,
):
    """A DataLoader that prepares whole steps ahead of compute in background workers.

    The workers persist from one epoch to the next (starting a pool per epoch costs a process
    each time), and start fresh (:func:`worker_context`). An exception in a worker is
    re-raised in the training process by the DataLoader, so the run stops with it (and
    ``torchrun`` stops the other ranks) instead of waiting forever.
    """
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        shuffle=False,
        sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=prefetch if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        collate_fn=None,
        timeout=0,
        worker_init_fn=_start_worker,
        multiprocessing_context=worker_context() if num_workers > 0 else None,
    )


def worker_context() -> multiprocessing.context.BaseContext:
    """Loader workers start as fresh processes (spawn), never forked from the rank: torch's
    worker loop calls ``torch.set_num_threads(1)`` first, and in a child forked from a rank
    whose threads held a lock of torch's thread pool at that moment, the call waited on the lock
    forever (once in ~25 runs under load), leaving the worker and its rank hung. A spawned
    worker imports torch itself (seconds, once a run: the workers persist), and it is still the
    rank's child, so it dies with the rank (:func:`_start_worker`); a fork server's children
    would outlive it."""
    _quiet_resource_tracker()
    return multiprocessing.get_context("spawn")


TRACKER_WARNINGS = "ignore::UserWarning:multiprocessing.resource_tracker"
"""The ``-W`` option that keeps the resource tracker from warning of leaked semaphores."""


def _quiet_resource_tracker() -> None:
    """Spawned workers' queues register their semaphores with Python's resource tracker, a
    process the rank starts with the rank's ``-W`` options. A rank stopped by a signal ends
    without teardown (:func:`dflash.commands.exits.exit_rank`), so the tracker removes the
    semaphores and warns of each, in lines printed after the run's own last line. Those
    removals are expected, so the tracker is told not to warn."""
    if TRACKER_WARNINGS not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_WARNINGS)


def _start_worker(worker_id: int) -> None:
    """A worker ends the moment its rank does: the DataLoader's own check of its parent runs
    only every few seconds, so a stopped run would leave workers behind that long. Its exit
    skips the teardown's collection, as a rank's does (:mod:`dflash.heap`)."""
    die_with_parent()
    skip_exit_collection()
