"""One training step of a rank, up to the optimizer: features → drafter → loss → gradients.

The loss is normalised by the loss-weight sum of the whole step over all ranks, computed before
the forward from the anchors, so every token weighs the same whatever the batching strategy or
the way samples fall onto ranks. Gradients accumulate over the rank's micro-batches and are
averaged over ranks (DDP all-reduce or FSDP reduce-scatter) on the last one only.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from dflash.model.features import target_features
from dflash.model.objective import ObjectiveOutput, dflash_objective
from dflash.train.batches import MicroBatch
from dflash.train.distributed import Dist, all_reduce_sum
from dflash.train.parallel import borrowed_unsharded, no_sync

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
    target: nn.Module, model: nn.Module, layer_ids: list[int], mb: MicroBatch, gamma: float
) -> ObjectiveOutput:
    """Target features without gradients, then the drafter and its loss on one micro-batch."""
    features = target_features(target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids)
    return drafter_loss(model, features, mb, gamma)


def drafter_loss(
    model: nn.Module, features: torch.Tensor, mb: MicroBatch, gamma: float
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
    )


def _global_sizes(ctx: Dist, micro_batches: list[MicroBatch]) -> list[float]:
    """Loss-weight sum, real and padded tokens, samples of the step over all ranks."""
    local = torch.tensor(
        [
            sum(mb.weight_sum for mb in micro_batches),
            sum(mb.real_tokens for mb in micro_batches),
            sum(mb.padded_tokens for mb in micro_batches),
            sum(mb.n_samples for mb in micro_batches),
        ],
        dtype=torch.float64,
    )
    return all_reduce_sum(ctx, local).tolist()


def forward_backward(
    ctx: Dist,
    target: nn.Module,
    model: nn.Module,
    layer_ids: list[int],
    micro_batches: list[MicroBatch],
    gamma: float,
    autocast: contextlib.AbstractContextManager,
) -> StepTotals:
    """Accumulate the step's gradients in ``model`` and return its totals over all ranks."""
    weight, real, padded, n_samples = _global_sizes(ctx, micro_batches)
    bs = model.config.block_size
    sums = torch.zeros(1 + 2 * bs, dtype=torch.float64)  # loss_sum, correct[bs], counted[bs]
    for i, mb in enumerate(micro_batches):
        mb = mb.to(ctx.device)
        last = i == len(micro_batches) - 1
        with autocast:
            features = target_features(
                target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids
            )
        with contextlib.nullcontext() if last else no_sync(model), borrowed_unsharded(model):
            with autocast:
                out = drafter_loss(model, features, mb, gamma)
            # Gradients are averaged over ranks: scaled, the sum is Σ w·CE / Σ_global w.
            (out.loss_sum * (ctx.world_size / max(weight, TINY_WEIGHT))).backward()
        parts = (out.loss_sum.detach()[None], out.correct, out.counted)
        sums += torch.cat([t.double().cpu() for t in parts])
    sums = all_reduce_sum(ctx, sums)
    return StepTotals(
        loss=sums[0].item() / max(weight, TINY_WEIGHT),
        weight=weight,
        correct=sums[1 : 1 + bs],
        counted=sums[1 + bs :],
        real_tokens=int(real),
        padded_tokens=int(padded),
        n_samples=int(n_samples),
    )
