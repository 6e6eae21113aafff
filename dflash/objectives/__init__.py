"""The objective's losses, one module each: ``objective.loss`` picks one by its ``name``.

Each module defines ``OBJECTIVE = Loss(name=..., terms=...)`` and documents it in its
docstring's first paragraph, which ``docs/configuration.md`` shows; ``dflash.model.losses``
finds it and runs its terms over chunks of labels. The position weights are the sub-package
``weights``: they belong to the same objective, and a loss and a weighting combine freely.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

Terms = Callable[[Tensor, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]]
"""``(log_q, q, target, log_p) -> (loss, d_logits)``: from the drafter's log-probabilities and
probabilities ``[n, V]`` (fp32), the label tokens ``[n]`` and, for a loss that distills, the
target's log-probabilities ``[n, V]``: each label's loss ``[n]`` and its gradient w.r.t. the
drafter's logits ``[n, V]``."""

Fused = Callable[[Tensor, Tensor, Tensor | None, Tensor, Tensor, int], tuple[Tensor, Tensor]]
"""``(hidden, weight, bias, target, weights, rows) -> (Σ w·loss, top-1 hits)``, an autograd
function's ``apply`` for weights known before the forward."""


@dataclass(frozen=True)
class Loss:
    """What each block slot is trained on (``objective.loss``)."""

    name: str
    terms: Terms
    distills: bool = False
    """Whether it reads the target's distribution (its last hidden state)."""
    fused: Fused | None = None
    """A faster kernel giving the same loss, used where the position weights are known before
    the forward."""
