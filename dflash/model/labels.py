"""What a micro-batch's objective reads of its layout, known before the forward: which block
labels count, where, and how much each weighs.

The DataLoader workers compute it on CPU tensors (:func:`label_plan`) and it travels with the
batch, so the step reads nothing of it back from the device; it needs torch alone, so a
spawned loader worker imports this and not the model code (:mod:`dflash.model.objective`
applies it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.model import position_weights
from dflash.model.drafter_attention import AnchorBlocks, build_attention_mask
from dflash.objectives.weights import PositionWeight


@functools.cache
def _device_slot_weights(
    weighting: PositionWeight, block_size: int, gamma: float, device: torch.device
) -> Tensor:
    """A weighting's slot weights on ``device``, built once: not a copy to it at every call."""
    return weighting.slots(block_size, gamma).to(device)


def gather_blocks(x: Tensor, anchors: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``x[p + k]`` for every anchor ``p`` and slot ``k`` (clamped into the row), and ``p + k``."""
    positions = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)
    safe = positions.clamp(0, x.shape[1] - 1).flatten(1)
    return x.gather(1, safe).view(positions.shape), positions


def label_counts(
    loss_mask: Tensor, document_ids: Tensor, anchors: Tensor, block_size: int
) -> Tensor:
    """``[R, A, bs]`` bool: where a block label counts.

    A label counts iff the anchor is real, ``k >= 1``, ``p + k`` is inside the row and in the
    anchor's document, and the loss mask covers it.
    """
    docs, positions = gather_blocks(document_ids, anchors, block_size)
    masked, _ = gather_blocks(loss_mask.bool(), anchors, block_size)
    anchor_doc = document_ids.gather(1, anchors.clamp(min=0))[:, :, None]
    return (
        (anchors[:, :, None] >= 0)
        & (positions > anchors[:, :, None])
        & (positions < document_ids.shape[1])
        & (docs == anchor_doc)
        & masked
    )


def block_labels(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Labels ``[R, A, bs]`` (``input_ids[p + k]``: same position, no shift) and where they
    count (``label_counts``)."""
    labels, _ = gather_blocks(input_ids, anchors, block_size)
    return labels, label_counts(loss_mask, document_ids, anchors, block_size)


def _check_anchors(document_ids: Tensor, anchors: Tensor) -> None:
    """Reads the anchors on the host: :func:`label_plan` runs it where they are still there."""
    T = document_ids.shape[1]
    real = anchors >= 0
    if (anchors < -1).any() or (anchors >= T).any():
        raise ValueError(f"anchors must be -1 (none) or a position in [0, {T}), got {anchors}")
    if (document_ids.gather(1, anchors.clamp(min=0))[real] < 0).any():
        raise ValueError("an anchor points at padding (document id -1)")


def one_row_documents(document_ids: Tensor) -> Tensor:
    """Rows laid end to end keep their documents apart: each row's ids shifted by ``row * T``."""
    R, T = document_ids.shape
    row = torch.arange(R, device=document_ids.device)[:, None]
    return torch.where(document_ids >= 0, document_ids + row * T, -1).reshape(1, R * T)


@dataclass(frozen=True)
class LabelPlan:
    """What the objective reads of a micro-batch's layout, known before the forward.

    Sized by the data (which anchors are real, which labels count), so computing it on a GPU
    would read the device back several times a micro-batch; the DataLoader workers compute it
    on the CPU instead (:func:`label_plan`) and it travels with the batch.
    """

    anchors: Tensor
    """``[1, N]``: the real anchors of the rows laid end to end (one -1 without any)."""
    index: Tensor
    """``[L]``: the counted labels, as places among the ``N * bs`` block slots."""
    slots: Tensor
    """``[L]``: each counted label's block slot."""
    weights: Tensor
    """``[L]`` float32: each counted label's weight known ahead (1 each for a weighting that
    depends on the drafter's output)."""
    counted: Tensor
    """``[bs]`` long: labels counted per block slot."""
    blocks: AnchorBlocks | None = None
    """The two-part kernel's context chunks, where that kernel runs (else built on the device)."""


def label_plan(
    loss_mask: Tensor,
    document_ids: Tensor,
    anchors: Tensor,
    block_size: int,
    gamma: float,
    *,
    blocks: bool,
    position_weight: str = "decay",
) -> LabelPlan:
    """The :class:`LabelPlan` of a micro-batch of ``R`` rows, its anchors checked; with the
    two-part kernel's chunks if ``blocks``.

    The one home of the weights known ahead: the objective weighs its loss with ``weights``,
    and the data loader sums them ahead of the forward (``MicroBatch.weight_sum``) to normalise
    it. A weighting that depends on the drafter's output (D-PACE) has every label weigh 1 here,
    and the loss is normalised by the label count, as speculators does.
    """
    weighting = position_weights.position_weight(position_weight)
    _check_anchors(document_ids, anchors)
    R, T = document_ids.shape
    row = torch.arange(R, device=anchors.device)[:, None]
    real = (anchors + row * T)[anchors >= 0]
    if real.numel() == 0:
        real = anchors.new_full((1,), -1)
    real, documents = real[None], one_row_documents(document_ids)
    counts = label_counts(loss_mask.reshape(1, R * T), documents, real, block_size)
    index = torch.nonzero(counts.flatten())[:, 0]
    slots = index % block_size
    mask = build_attention_mask(real, documents, block_size, R * T, flex=False) if blocks else None
    return LabelPlan(
        anchors=real,
        index=index,
        slots=slots,
        weights=(
            _device_slot_weights(weighting, block_size, gamma, index.device)[slots]
            if weighting.slots is not None
            else torch.ones(slots.shape, dtype=torch.float32, device=index.device)
        ),
        counted=torch.bincount(slots, minlength=block_size),
        blocks=mask,
    )
