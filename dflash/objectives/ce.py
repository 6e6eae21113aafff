"""``ce``: cross-entropy against the data token at each block slot (the paper).

Besides its per-label terms it has a fused kernel, which ``dflash.model.objective`` takes when
the position weights are known before the forward: the default objective's path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.objectives import Loss


def terms(log_q: Tensor, q: Tensor, target: Tensor, log_p: Tensor | None) -> tuple[Tensor, Tensor]:
    """``-log q(label)``, and ``softmax - one_hot`` as its gradient w.r.t. the logits."""
    rows = torch.arange(len(target), device=q.device)
    d_logits = q.clone()
    d_logits[rows, target] -= 1.0
    return -log_q.gather(1, target[:, None])[:, 0], d_logits


class ChunkedHeadLoss(torch.autograd.Function):
    """``Σ w * CE(lm_head(hidden), target)`` and top-1 hits without the full logits.

    The LM head is frozen, so the only gradient is the one w.r.t. ``hidden``; it is computed
    chunk by chunk in the forward, while each chunk's fp32 logits exist, and kept as one
    ``[N, H]`` tensor. Logits never exist for more than one chunk of ``rows`` labels.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, weights, rows):
        loss = hidden.new_zeros((), dtype=torch.float32)
        hits = torch.empty_like(target, dtype=torch.bool)
        grad = torch.empty_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        for i in range(0, hidden.shape[0], rows):
            part = slice(i, i + rows)
            logits = F.linear(hidden[part].to(weight.dtype), weight, bias).float()
            top, best = logits.max(dim=-1)
            hits[part] = best == target[part]
            picked = logits.gather(1, target[part, None])[:, 0]
            probs = logits.sub_(top[:, None]).exp_()  # in place: one [rows, V] buffer
            total = probs.sum(dim=-1)
            loss += (weights[part] * (top + total.log() - picked)).sum()
            if grad is not None:  # d CE / d logits = softmax - one_hot, then through the head
                probs.mul_((weights[part] / total)[:, None])
                probs[torch.arange(len(top), device=probs.device), target[part]] -= weights[part]
                grad[part] = probs.to(weight.dtype) @ weight
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        (grad,) = ctx.saved_tensors
        return (grad_loss * grad).to(ctx.hidden_dtype), None, None, None, None, None


OBJECTIVE = Loss(name="ce", terms=terms, fused=ChunkedHeadLoss.apply)
