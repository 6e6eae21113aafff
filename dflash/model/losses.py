"""The objective's loss by name, and the head maths that applies any of them.

``objective.loss`` names a module of ``dflash.objectives`` (or an installed plug-in) that
defines ``OBJECTIVE = Loss(name=..., terms=...)``; :func:`loss` loads it. Its
``terms`` say, per label, the loss and its gradient w.r.t. the drafter's logits; a loss that
``distills`` also reads the target's distribution there (temperature 1, the target's last
hidden state through the shared LM head), and the feature sources then hand over that hidden
state. :class:`WeightedHeadLoss` runs the terms chunk by chunk: logits exist for one chunk of
labels at a time, drafter's and target's alike, and the gradient w.r.t. the drafter's hidden
states is computed in the forward. Each label's gradient is kept unweighted and scaled once the
weights are known, since some position weights depend on the drafter's confidence over the
whole block (``dflash.model.position_weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.config import plugins
from dflash.objectives import Loss

PLUGIN_PACKAGE = "dflash.objectives"
ATTRIBUTE = "OBJECTIVE"
KEY = "objective.loss"


def loss(name: str) -> Loss:
    """The loss ``objective.loss = name`` picks."""
    return plugins.load(PLUGIN_PACKAGE, ATTRIBUTE, name, Loss, KEY)


def log_softmax_rows(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probabilities ``[n, V]`` and probabilities of fp32 ``logits``."""
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
    return log_probs, log_probs.exp()


def head_terms(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    teacher: Tensor | None,
    objective: Loss,
    rows: int,
    *,
    grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Per label: its loss ``[N]``, the drafter's probability of the label token ``[N]``, top-1
    hits ``[N]`` and the unweighted gradient w.r.t. ``hidden`` ``[N, H]`` (if ``grad``).

    ``teacher [N, H]`` is the target's last hidden state at the position before each label,
    which a loss that distills reads; its logits pass through the same frozen head.
    """
    n = hidden.shape[0]
    losses = hidden.new_zeros(n, dtype=torch.float32)
    confidence = hidden.new_zeros(n, dtype=torch.float32)
    hits = torch.empty_like(target, dtype=torch.bool)
    grads = torch.empty_like(hidden, dtype=torch.float32) if grad else None
    for i in range(0, n, rows):
        part = slice(i, i + rows)
        log_q, q = log_softmax_rows(F.linear(hidden[part].to(weight.dtype), weight, bias).float())
        hits[part] = log_q.argmax(dim=-1) == target[part]
        confidence[part] = log_q.gather(1, target[part, None])[:, 0].exp()
        log_p = None
        if objective.distills:
            t = F.linear(teacher[part].to(weight.dtype), weight, bias).float()
            log_p = log_softmax_rows(t)[0]
        losses[part], d_logits = objective.terms(log_q, q, target[part], log_p)
        if grads is not None:
            grads[part] = d_logits.to(weight.dtype) @ weight
    return losses, confidence, hits, grads


class WeightedHeadLoss(torch.autograd.Function):
    """``Σ w * loss(lm_head(hidden))`` with ``w`` the given weights, or the weights ``reweigh``
    builds from the labels' confidence where it is given."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, teacher, weights, rows, objective, reweigh):
        losses, confidence, hits, grads = head_terms(
            hidden, weight, bias, target, teacher, objective, rows, grad=ctx.needs_input_grad[0]
        )
        if reweigh is not None:
            weights = reweigh(confidence)
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
        none = (None,) * 8
        return ((grad_loss * grads).to(ctx.hidden_dtype), *none)
