"""One training step of a rank: features → drafter → loss → gradients → one optimizer update.

The loss is normalised by the loss-weight sum of the whole step over all ranks, computed before
the forward from the anchors, so every token weighs the same whatever the batching strategy or
the way samples fall onto ranks. Gradients accumulate over the rank's micro-batches and are
averaged over ranks (DDP all-reduce or FSDP reduce-scatter) on the last one only. Then they are
clipped and the optimizer steps, unless the loss or the gradients are not finite: that step is
skipped and counted, and ``train.max_nonfinite_steps`` of them in a row stop the run.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from dflash.errors import RunStopped
from dflash.features.source import FeatureSource
from dflash.features.target_forward import micro_batch_features
from dflash.model.objective import PAPER, Objective, ObjectiveOutput, dflash_objective
from dflash.train.batches import MicroBatch
from dflash.train.checkpointing.state import TrainState
from dflash.train.distributed.parallel import borrowed_unsharded, clip_grad_norm, no_sync
from dflash.train.distributed.process_group import Dist, all_reduce_sum
from dflash.train.optim import Optimization

TINY_WEIGHT = 1e-12
"""Floor of the step's loss-weight sum: a step without labels divides by it, not by zero."""


class TrainingError(RunStopped):
    """The run cannot go on (too many non-finite losses, a stale plan, ...)."""


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


@dataclass(frozen=True)
class Step:
    """What every step of a run works with, built once (:func:`dflash.train.build.build_step`)."""

    ctx: Dist
    model: nn.Module
    """The drafter as it trains: wrapped for DDP, or sharded by FSDP."""
    params: list[nn.Parameter]
    """Its trainable parameters: the ones clipped."""
    features: FeatureSource
    objective: Objective
    gamma: float
    autocast: contextlib.AbstractContextManager
    optim: Optimization
    clip_grad: float
    max_nonfinite: int


def train_step(step: Step, micro_batches: list[MicroBatch], state: TrainState) -> dict[str, Any]:
    """Gradients of the step's micro-batches, clipped, then one update unless the loss is not
    finite; the step's figures for the logs."""
    s = step
    totals = forward_backward(s.ctx, s.model, micro_batches, s.features, s.gamma, s.autocast,
                              s.objective)  # fmt: skip
    grad_norm = clip_grad_norm(s.params, s.clip_grad)
    lr = s.optim.lr
    finite = math.isfinite(totals.loss) and math.isfinite(grad_norm) and totals.weight > 0
    if finite:
        s.optim.step()
        state.nonfinite_in_a_row = 0
    else:
        skip_step(state, s.max_nonfinite)
    s.optim.zero_grad()
    s.optim.schedule_step()
    return {**totals._asdict(), "finite": finite, "grad_norm": grad_norm, "lr": lr}


def skip_step(state: TrainState, limit: int) -> None:
    """Count a step whose update was skipped; ``limit`` of them in a row stop the run."""
    state.skipped_steps += 1
    state.nonfinite_in_a_row += 1
    if state.nonfinite_in_a_row >= limit:
        raise TrainingError(
            f"{state.nonfinite_in_a_row} non-finite losses in a row (limit "
            f"train.max_nonfinite_steps = {limit}) at global step "
            f"{state.global_step}: lower train.lr or check the data"
        )


def forward_backward(
    ctx: Dist,
    model: nn.Module,
    micro_batches: list[MicroBatch],
    features: FeatureSource,
    gamma: float,
    autocast: contextlib.AbstractContextManager,
    objective: Objective = PAPER,
) -> StepTotals:
    """Accumulate the step's gradients in ``model`` and return its totals over all ranks.

    The totals stay on the device until the last micro-batch's backward is queued: one read
    back a step, none a micro-batch (``tests/test_train_syncs.py``).
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
            context = features(mb)
        with contextlib.nullcontext() if last else no_sync(model), borrowed_unsharded(model):
            with autocast:
                out = drafter_loss(model, context, mb, gamma, objective)
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
