"""``kl``: KL divergence to the target's next-token distribution at each block slot
(temperature 1, its logits from its last hidden state through the LM head, so the target runs
all its layers)."""

from __future__ import annotations

from torch import Tensor

from dflash.objectives import Loss


def terms(log_q: Tensor, q: Tensor, target: Tensor, log_p: Tensor | None) -> tuple[Tensor, Tensor]:
    """``KL(p || q)``, and ``q - p`` as its gradient w.r.t. the drafter's logits."""
    p = log_p.exp()
    return (p * (log_p - log_q)).sum(dim=-1), q - p


OBJECTIVE = Loss(name="kl", terms=terms, distills=True)
