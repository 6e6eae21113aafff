"""The DFlash training objective on a micro-batch of rows.

Each anchor ``p`` opens a block ``[input_ids[p], MASK x (bs-1)]``. Slot ``k`` is trained to
predict ``input_ids[p + k]`` — the *same* position, no shift: slot 0 holds the anchor token itself
and is excluded, and the context it sees stops strictly before ``p``. This is exactly what the
drafter faces at inference; shifting the labels by one or letting the context reach ``p`` trains
something else, and acceptance collapses to ~1 (SpecForge #455).
What each slot is trained on and how slots weigh are extension points, a module each
(``dflash.model.losses``, ``dflash.model.position_weights``); the paper's is cross-entropy with
early slots weighing most, since a rejection ends the block. Sums are returned, not means: the
trainer divides by the weight sum over all ranks and micro-batches, so every token weighs the
same whatever the batching.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dflash.model import losses, position_weights
from dflash.model.drafter import PAPER_RULE, DFlashDrafter, layer_rules, rule_masks
from dflash.model.drafter_attention import build_attention_mask, flex_available
from dflash.model.labels import LabelPlan, gather_blocks, label_plan, one_row_documents
from dflash.model.losses import WeightedHeadLoss
from dflash.objectives import Loss


class Objective(NamedTuple):
    """What the loss is and how block slots weigh: ``objective`` in params.yaml."""

    loss: str = "ce"
    position_weight: str = "decay"
    dpace_alpha: float = 0.5
    selector_alpha: float = 1.0
    """Weight of a drafter's own extra term (``extra_loss``), where it has one."""

    @property
    def distills(self) -> bool:
        """Whether the loss reads the target's distribution (its last hidden state)."""
        return losses.loss(self.loss).distills


PAPER = Objective()
"""Decay-weighted cross-entropy: the default."""


def objective_of(config) -> Objective:
    """The :class:`Objective` of a params ``Config`` (its ``objective`` section)."""
    o = config.objective
    return Objective(o.loss, o.position_weight, o.dpace_alpha, o.selector_alpha)


class ObjectiveOutput(NamedTuple):
    loss_sum: Tensor
    """Scalar Σ w·loss, with gradient."""
    weight_sum: Tensor
    """Scalar Σ w over the counted labels."""
    correct: Tensor
    """``[bs]`` long: top-1 hits per block slot (slot 0 always 0)."""
    counted: Tensor
    """``[bs]`` long: labels counted per block slot (slot 0 always 0)."""


def _check_shapes(input_ids, loss_mask, document_ids, position_ids, anchors) -> None:
    shapes = {t.shape for t in (input_ids, loss_mask, document_ids, position_ids)}
    if len(shapes) != 1 or input_ids.ndim != 2:
        raise ValueError(
            "input_ids, loss_mask, document_ids and position_ids must share one [R, T] shape, got "
            f"{[tuple(t.shape) for t in (input_ids, loss_mask, document_ids, position_ids)]}"
        )
    if anchors.ndim != 2 or anchors.shape[0] != input_ids.shape[0]:
        raise ValueError(f"anchors must be [R, A], got {tuple(anchors.shape)}")


LOGITS_PER_CHUNK = 1 << 24
"""Logit elements (labels x vocab) held at once by the loss: 64 MiB of fp32 per buffer (on a
GPU, more where that leaves fewer than ``MIN_DEVICE_ROWS`` labels)."""

HEAP_LOGITS = 1 << 22
"""On CPU, logits of a chunk held in 16 MiB where that still leaves ``MIN_HEAP_ROWS`` labels a
chunk. glibc maps every buffer over 32 MiB afresh and the kernel faults it in page by page, at
every micro-batch; a smaller one is reused from the heap (``bench/loss_chunks.py``)."""

MIN_HEAP_ROWS = 1024
"""Each chunk reads the whole head: with a large vocabulary, fewer labels a chunk cost more
than the page faults saved (27 labels a chunk of 151,936 logits took 1.6x the time of 110)."""

MIN_DEVICE_ROWS = 2048
"""Labels per chunk at least on a GPU. Each chunk reads the whole head twice (logits, then the
gradient), 1.2 GB for Qwen3-8B's in bf16: at 2^24 logits a chunk (110 labels of a 152K
vocabulary) the matmuls wait on that read, some 280 times a micro-batch of 30K labels; at
2,048 labels their FLOPs bound them. The price is a larger transient: 2,048 x 152K logits in
fp32 plus a bf16 copy, 1.9 GB (``bench/memory_model.py``)."""


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Labels per chunk of the loss."""
    if device.type != "cpu":
        return max(MIN_DEVICE_ROWS, LOGITS_PER_CHUNK // vocab_size)
    heap_rows = HEAP_LOGITS // vocab_size
    if heap_rows >= MIN_HEAP_ROWS:
        return heap_rows
    return max(1, LOGITS_PER_CHUNK // vocab_size)


def _one_row(features, input_ids, loss_mask, document_ids, position_ids):
    """The micro-batch as one row of ``R*T`` tokens, which :class:`LabelPlan` fills with only
    its real anchors.

    Anchor slots padded to the busiest row (in packed rows most of them) would cost the drafter
    as much as real ones. Laid end to end, rows keep their documents apart
    (:func:`one_row_documents`); the rule needs nothing else.
    """
    R, T = input_ids.shape
    flat = [x.reshape(1, R * T) for x in (input_ids, loss_mask, position_ids)]
    return (
        features.reshape(1, R * T, -1),
        flat[0],
        flat[1],
        one_row_documents(document_ids),
        flat[2],
    )


def dflash_objective(
    drafter: DFlashDrafter,
    features: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    document_ids: Tensor,
    position_ids: Tensor,
    anchors: Tensor,
    gamma: float,
    *,
    flex: bool | None = None,
    plan: LabelPlan | None = None,
    objective: Objective = PAPER,
) -> ObjectiveOutput:
    """The loss of ``R`` rows of ``T`` tokens with ``A`` anchors each, as ``objective`` says:
    by default decay-weighted block cross-entropy.

    ``flex`` forces FlexAttention (True) or the two-part kernel (False); None picks
    FlexAttention on CUDA. ``plan`` is :func:`label_plan` of these inputs, computed ahead (then
    nothing here reads the device back); without it, it is computed here. A loss that distills
    takes ``features`` with the target's last hidden state as their last columns
    (``target_features(..., last=True)``). A drafter with an ``extra_loss(hidden [1, N*bs, H],
    labels [1, N, bs], plan, objective)`` (DDP's inner module included) adds that weighted sum
    of its own term to the head's.
    """
    _check_shapes(input_ids, loss_mask, document_ids, position_ids, anchors)
    if features.shape[:2] != input_ids.shape:
        raise ValueError(f"features {tuple(features.shape)} do not match [R, T] {input_ids.shape}")
    if flex is None:
        flex = flex_available(anchors.device)
    bs = drafter.config.block_size
    if plan is None:
        plan = label_plan(
            loss_mask, document_ids, anchors, bs, gamma, blocks=not flex,
            position_weight=objective.position_weight,
        )  # fmt: skip
    term = losses.loss(objective.loss)
    teacher = None
    if term.distills:
        width = drafter.head()[0].shape[1]
        features, teacher = features[..., :-width], features[..., -width:]
    features, input_ids, loss_mask, document_ids, position_ids = _one_row(
        features, input_ids, loss_mask, document_ids, position_ids
    )
    hidden = _draft(drafter, features, input_ids, document_ids, position_ids, plan, flex)
    labels, _ = gather_blocks(input_ids, plan.anchors, bs)
    out = _head_loss(drafter, hidden, labels, teacher, plan, objective, term)
    extra = getattr(getattr(drafter, "module", drafter), "extra_loss", None)
    if extra is None:
        return out
    return out._replace(loss_sum=out.loss_sum + extra(hidden, labels, plan, objective))


def _draft(drafter, features, input_ids, document_ids, position_ids, plan, flex) -> Tensor:
    """The drafter's hidden states ``[1, N * bs, H]`` of the plan's blocks in the one row."""
    bs, anchors, T = drafter.config.block_size, plan.anchors, input_ids.shape[1]
    slot = torch.arange(bs, device=anchors.device)
    safe_anchor = anchors.clamp(min=0)
    first = input_ids.gather(1, safe_anchor)[:, :, None]
    block_ids = torch.where(slot == 0, first, drafter.config.mask_token_id)
    block_positions = position_ids.gather(1, safe_anchor)[:, :, None] + slot
    if plan.blocks is not None and not flex:
        mask = plan.blocks
    else:
        mask = build_attention_mask(anchors, document_ids, bs, T, flex)
    rules = layer_rules(drafter.config)
    if rules != {PAPER_RULE}:
        mask = rule_masks(
            mask, rules, anchors, document_ids, bs, position_ids, block_positions.flatten(1)
        )
    return drafter(block_ids.flatten(1), block_positions.flatten(1), features, position_ids, mask)


def _head_loss(
    drafter: DFlashDrafter,
    hidden: Tensor,
    labels: Tensor,
    teacher: Tensor | None,
    plan: LabelPlan,
    objective: Objective,
    term: Loss,
) -> ObjectiveOutput:
    """The counted labels' loss through the LM head: the loss's fused kernel where the weights
    are known ahead and it has one, else its terms weighted as ``objective`` says."""
    weight, bias = drafter.head()
    rows = chunk_rows(weight.shape[0], weight.device)
    weighting = position_weights.position_weight(objective.position_weight)
    anchors, bs = plan.anchors, labels.shape[-1]
    picked = hidden.flatten(0, 1).index_select(0, plan.index)
    targets = labels.flatten().index_select(0, plan.index)
    if term.fused is not None and weighting.slots is not None:
        loss_sum, hits = term.fused(picked, weight, bias, targets, plan.weights, rows)
        return _output(loss_sum, hits, plan, bs)
    taught = None
    if teacher is not None:  # the target's distribution of the token at p + k is read at p + k - 1
        before = anchors[:, :, None] + torch.arange(bs, device=anchors.device) - 1
        places = before.clamp(min=0).flatten().index_select(0, plan.index)
        taught = teacher.flatten(0, 1).index_select(0, places)
    reweigh = None
    if weighting.confidence is not None:
        reweigh = weighting.labels(plan.index, (anchors.shape[1], bs), objective)
    loss_sum, hits, _ = WeightedHeadLoss.apply(
        picked, weight, bias, targets, taught, plan.weights, rows, term, reweigh
    )
    return _output(loss_sum, hits, plan, bs)


def _output(loss_sum: Tensor, hits: Tensor, plan: LabelPlan, bs: int) -> ObjectiveOutput:
    """Per-slot hits gathered back from the plan's flat labels, beside the sums."""
    correct = torch.zeros(bs, dtype=torch.long, device=hits.device)
    return ObjectiveOutput(
        loss_sum=loss_sum,
        weight_sum=plan.weights.sum(),
        correct=correct.index_add_(0, plan.slots, hits.long()),
        counted=plan.counted,
    )
