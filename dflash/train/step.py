"""One training step of a rank, up to the optimizer: features → drafter → loss → gradients.

The loss is normalised by the loss-weight sum of the whole step over all ranks, computed before
the forward from the anchors, so every token weighs the same whatever the batching strategy or
the way samples fall onto ranks. Gradients accumulate over the rank's micro-batches and are
averaged over ranks (DDP all-reduce or FSDP reduce-scatter) on the last one only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from dflash.model.distill import PAPER, Objective
from dflash.model.features import target_features
from dflash.model.objective import ObjectiveOutput, dflash_objective
from dflash.train.batches import MicroBatch
from dflash.train.distributed.parallel import borrowed_unsharded, no_sync
from dflash.train.distributed.process_group import Dist, all_reduce_sum

TINY_WEIGHT = 1e-12
"""Floor of the step's loss-weight sum: a step without labels divides by it, not by zero."""


class StepTotals(NamedTuple):
    """A step summed over its micro-batches and all ranks."""

    loss: float
    """Σ w·CE / Σ w: the step's loss, as its gradients were scaled."""
    weight: float
    correct: torch.Tensor
    """``[bs]`` float64 top-1 hits per block slot."""
    counted: torch.Tensor
    real_tokens: int
    padded_tokens: int
    n_samples: int


def micro_batch_loss(
    target: nn.Module,
    model: nn.Module,
    layer_ids: list[int],
    mb: MicroBatch,
    gamma: float,
    objective: Objective = PAPER,
) -> ObjectiveOutput:
    """Target features without gradients, then the drafter and its loss on one micro-batch."""
    features = micro_batch_features(target, layer_ids, mb, objective.distills)
    return drafter_loss(model, features, mb, gamma, objective)


def micro_batch_features(
    target: nn.Module, layer_ids: list[int], mb: MicroBatch, last: bool = False
) -> torch.Tensor:
    """The target features of one micro-batch, run the way its loader laid its rows out (with
    the target's last hidden state after them where ``last``)."""
    return target_features(
        target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids, mb.layout, last=last
    )


def drafter_loss(
    model: nn.Module,
    features: torch.Tensor,
    mb: MicroBatch,
    gamma: float,
    objective: Objective = PAPER,
) -> ObjectiveOutput:
    """The drafter and its loss on one micro-batch, given its target features."""
    return dflash_objective(
        model,
        features,
        mb.input_ids,
        mb.loss_mask,
        mb.document_ids,
        mb.position_ids,
        mb.anchors,
        gamma,
        plan=mb.label_plan,
        objective=objective,
    )


def _global_sizes(ctx: Dist, micro_batches: list[MicroBatch]) -> torch.Tensor:
    """Loss-weight sum, real and padded tokens, samples of the step over all ranks: float64
    on the step's device, read on the host only with the step's totals."""
    local = torch.tensor(
        [
            sum(mb.weight_sum for mb in micro_batches),
            sum(mb.real_tokens for mb in micro_batches),
            sum(mb.padded_tokens for mb in micro_batches),
            sum(mb.n_samples for mb in micro_batches),
        ],
        dtype=torch.float64,
    )
    return all_reduce_sum(ctx, local)


def forward_backward(
    ctx: Dist,
    target: nn.Module | None,
    model: nn.Module,
    layer_ids: list[int] | None,
    micro_batches: list[MicroBatch],
    gamma: float,
    autocast: contextlib.AbstractContextManager,
    features_of: Callable[[MicroBatch], torch.Tensor] | None = None,
    objective: Objective = PAPER,
) -> StepTotals:
    """Accumulate the step's gradients in ``model`` and return its totals over all ranks.

    The totals stay on the device until the last micro-batch's backward is queued: one read
    back a step, none a micro-batch (``tests/test_train_syncs.py``). ``features_of``, when
    given, replaces ``target``: the features a decoupled run's target ranks send
    (:mod:`dflash.train.topology`).
    """
    sizes = _global_sizes(ctx, micro_batches)
    # Gradients are averaged over ranks: scaled, the sum is Σ w·CE / Σ_global w.
    world = torch.tensor(float(ctx.world_size), dtype=torch.float64, device=ctx.device)
    scale = (world / sizes[0].clamp(min=TINY_WEIGHT)).float()
    bs = model.config.block_size
    # loss_sum, correct[bs], counted[bs]
    sums = torch.zeros(1 + 2 * bs, dtype=torch.float64, device=ctx.device)
    for i, mb in enumerate(micro_batches):
        mb = mb.to(ctx.device)
        last = i == len(micro_batches) - 1
        with autocast:
            features = (
                micro_batch_features(target, layer_ids, mb, objective.distills)
                if features_of is None
                else features_of(mb)
            )
        with contextlib.nullcontext() if last else no_sync(model), borrowed_unsharded(model):
            with autocast:
                out = drafter_loss(model, features, mb, gamma, objective)
            (out.loss_sum * scale).backward()
        parts = (out.loss_sum.detach()[None], out.correct, out.counted)
        sums += torch.cat([t.double() for t in parts])
    totals = torch.cat([all_reduce_sum(ctx, sums), sizes]).tolist()  # the step's one read
    weight, real, padded, n_samples = totals[-4:]
    return StepTotals(
        loss=totals[0] / max(weight, TINY_WEIGHT),
        weight=weight,
        correct=torch.tensor(totals[1 : 1 + bs], dtype=torch.float64),
        counted=torch.tensor(totals[1 + bs : 1 + 2 * bs], dtype=torch.float64),
        real_tokens=int(real),
        padded_tokens=int(padded),
        n_samples=int(n_samples),
    )
