"""The objective's other losses and position weights: KL to the target, and D-PACE.

``kl`` trains each block slot toward the target's own next-token distribution at that position
(temperature 1), the logits coming from the target's last hidden state through the shared LM
head; ``ce+kl`` adds the data token's cross-entropy to it. Like the default loss, logits exist
for one chunk of labels at a time, drafter's and target's alike, and the gradient w.r.t. the
drafter's hidden states is computed chunk by chunk in the forward. Each label's gradient is
kept unweighted and scaled once the weights are known, since D-PACE's weights depend on the
drafter's confidence over the whole block.

D-PACE (as speculators defines it) weighs slot ``k`` of a block by the expected number of
tokens accepted from ``k`` on: with ``q_j`` the drafter's probability of slot ``j``'s label,
smoothed to ``s_j = (1 - alpha) q_j + alpha``, ``w_k = Σ_{t >= k} Π_{j <= t} s_j`` over the
block's counted slots. The weights carry no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("ce", "kl", "ce+kl")
POSITION_WEIGHTS = ("decay", "dpace")


class Objective(NamedTuple):
    """What the loss is and how block slots weigh: ``objective`` in params.yaml."""

    loss: str = "ce"
    position_weight: str = "decay"
    dpace_alpha: float = 0.5

    @property
    def distills(self) -> bool:
        """Whether the loss reads the target's distribution (its last hidden state)."""
        return "kl" in self.loss

    @property
    def default(self) -> bool:
        """The paper's objective: decay-weighted cross-entropy."""
        return self.loss == "ce" and self.position_weight == "decay"


PAPER = Objective()
"""Decay-weighted cross-entropy: the default."""


def objective_of(config) -> Objective:
    """The :class:`Objective` of a params ``Config`` (its ``objective`` section)."""
    o = config.objective
    return Objective(o.loss, o.position_weight, o.dpace_alpha)


def dpace_weights(confidence: Tensor, counted: Tensor, alpha: float) -> Tensor:
    """``[B, bs]`` D-PACE weights of blocks whose slots have ``confidence`` (the drafter's
    probability of the label) where ``counted``; 0 elsewhere. A slot that does not count
    neither weighs nor lowers the odds of reaching the later ones."""
    counts = counted.to(confidence.dtype)
    smooth = torch.where(counted, (1.0 - alpha) * confidence + alpha, 1.0)
    reach = torch.cumprod(smooth, dim=-1) * counts
    return reach.flip(-1).cumsum(-1).flip(-1) * counts


def _log_softmax_rows(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probabilities ``[n, V]`` and probabilities of fp32 ``logits``."""
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
    return log_probs, log_probs.exp()


def head_terms(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    teacher: Tensor | None,
    loss: str,
    rows: int,
    *,
    grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per label: its loss ``[N]``, the drafter's probability of the label token ``[N]``, top-1
    hits ``[N]`` and the unweighted gradient w.r.t. ``hidden`` ``[N, H]`` (if ``grad``).

    ``teacher [N, H]`` is the target's last hidden state at the position before each label,
    which ``kl`` needs; its logits pass through the same frozen head.
    """
    n = hidden.shape[0]
    losses = hidden.new_zeros(n, dtype=torch.float32)
    confidence = hidden.new_zeros(n, dtype=torch.float32)
    hits = torch.empty_like(target, dtype=torch.bool)
    grads = torch.empty_like(hidden, dtype=torch.float32) if grad else None
    for i in range(0, n, rows):
        part = slice(i, i + rows)
        log_q, q = _log_softmax_rows(F.linear(hidden[part].to(weight.dtype), weight, bias).float())
        hits[part] = log_q.argmax(dim=-1) == target[part]
        picked = log_q.gather(1, target[part, None])[:, 0]
        confidence[part] = picked.exp()
        d_logits = torch.zeros_like(q)
        if loss in ("ce", "ce+kl"):
            losses[part] += -picked
            d_logits += q
            d_logits[torch.arange(len(picked), device=q.device), target[part]] -= 1.0
        if loss in ("kl", "ce+kl"):
            t = F.linear(teacher[part].to(weight.dtype), weight, bias).float()
            log_p, p = _log_softmax_rows(t)
            losses[part] += (p * (log_p - log_q)).sum(dim=-1)
            d_logits += q - p
        if grads is not None:
            grads[part] = d_logits.to(weight.dtype) @ weight
    return losses, confidence, hits, grads


class WeightedHeadLoss(torch.autograd.Function):
    """``Σ w * loss(lm_head(hidden))`` with ``w`` the given weights, or D-PACE weights built
    from the labels' confidence when ``blocks`` (their places in ``[B, bs]``) is given."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, teacher, weights, rows, loss, blocks, alpha):
        losses, confidence, hits, grads = head_terms(
            hidden, weight, bias, target, teacher, loss, rows, grad=ctx.needs_input_grad[0]
        )
        if blocks is not None:
            index, shape = blocks
            dense = confidence.new_zeros(shape).flatten()
            counted = torch.zeros(dense.shape, dtype=torch.bool, device=dense.device)
            dense[index], counted[index] = confidence, True
            weights = dpace_weights(dense.view(shape), counted.view(shape), alpha).flatten()[index]
        total = (weights * losses).sum()
        if grads is not None:
            grads.mul_(weights[:, None])
        ctx.save_for_backward(grads)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(hits, weights)
        return total, hits, weights

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits, _grad_weights):
        (grads,) = ctx.saved_tensors
        none = (None,) * 9
        return ((grad_loss * grads).to(ctx.hidden_dtype), *none)
