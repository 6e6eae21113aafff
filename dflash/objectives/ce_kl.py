"""``ce+kl``: the sum of ``ce`` and ``kl``."""

from __future__ import annotations

from torch import Tensor

from dflash.objectives import Loss, ce, kl


def terms(log_q: Tensor, q: Tensor, target: Tensor, log_p: Tensor | None) -> tuple[Tensor, Tensor]:
    ce_loss, ce_grad = ce.terms(log_q, q, target, log_p)
    kl_loss, kl_grad = kl.terms(log_q, q, target, log_p)
    return ce_loss + kl_loss, ce_grad + kl_grad


OBJECTIVE = Loss(name="ce+kl", terms=terms, distills=True)
