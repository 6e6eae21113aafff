"""Builders for the drafter's optimizer and learning-rate schedule (``train.optimizer``,
``train.schedule``), so the loop steps one object whatever the choice.

Muon orthogonalises the momentum of a weight matrix by Newton–Schulz iterations; it is meant
for the 2-D weights of the hidden layers only. The drafter's input projection ``fc`` plays the
part of an embedding (it maps the tapped target features into the drafter), and norms are 1-D,
so those stay with AdamW. Muon's step is scaled to AdamW's update RMS (torch's
``match_rms_adamw``), so one ``train.lr`` and one schedule serve both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from dflash.train.checkpointing.parts import OptimizerPart

MUON_PREFIX = "layers."
"""Parameters under this name belong to the drafter's hidden layers: the ones Muon may take."""


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(muon, adamw)``: the trainable 2-D weights of the hidden layers, and the rest."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            hidden_matrix = name.startswith(MUON_PREFIX) and p.ndim == 2
            (muon if hidden_matrix else adamw).append(p)
    return muon, adamw


def build_optimizers(model: nn.Module, t: Any, fused: bool) -> list[torch.optim.Optimizer]:
    """One AdamW over every trainable parameter, or Muon and AdamW over :func:`muon_split`."""
    if t.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return [_adamw(params, t, fused)]
    muon, rest = muon_split(model)
    optimizers = [
        torch.optim.Muon(muon, lr=t.lr, weight_decay=t.weight_decay, adjust_lr_fn="match_rms_adamw")
    ]
    return optimizers + ([_adamw(rest, t, fused)] if rest else [])


def _adamw(params: list[nn.Parameter], t: Any, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=fused
    )


def warmup_steps(t: Any, total: int) -> int:
    """``train.warmup_steps``, or ``train.warmup_ratio`` of the run's steps, rounded up."""
    return t.warmup_steps if t.warmup_steps is not None else math.ceil(t.warmup_ratio * total)


def build_schedule(optimizer: torch.optim.Optimizer, t: Any, total: int) -> LambdaLR:
    """The ``train.schedule`` multiplier of ``train.lr`` over the run's ``total`` steps."""
    warmup = warmup_steps(t, total)
    schedules: dict[str, Callable[[], LambdaLR]] = {
        "cosine": lambda: get_cosine_schedule_with_warmup(optimizer, warmup, total),
        "linear": lambda: get_linear_schedule_with_warmup(optimizer, warmup, total),
        "constant": lambda: get_constant_schedule_with_warmup(optimizer, warmup),
        "wsd": lambda: get_wsd_schedule(
            optimizer,
            num_warmup_steps=warmup,
            num_decay_steps=decay_steps(t.decay_ratio, warmup, total),
            num_training_steps=total,
            decay_type="linear",
        ),
    }
    return schedules[t.schedule]()


def decay_steps(ratio: float, warmup: int, total: int) -> int:
    """The final ``ratio`` of the run's steps, rounded up, never reaching into the warm-up."""
    return min(math.ceil(ratio * total), max(total - warmup, 0))


@dataclass
class Optimization:
    """The run's optimizers and their schedules, stepped together."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[LambdaLR] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, t: Any, total: int, fused: bool) -> Optimization:
        optimizers = build_optimizers(model, t, fused)
        return cls(optimizers, [build_schedule(o, t, total) for o in optimizers])

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def schedule_step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    @property
    def lr(self) -> float:
        """The rate of this step (every optimizer follows the same schedule)."""
        return self.schedulers[0].get_last_lr()[0]

    def parts(self, model: nn.Module) -> dict[str, Any]:
        """Checkpointable parts; one AdamW is saved as it always was."""
        if len(self.optimizers) == 1:
            return {
                "optimizer": OptimizerPart(model, self.optimizers[0]),
                "scheduler": self.schedulers[0],
            }
        return {
            "optimizer": OptimizerPart(model, self.optimizers),
            "scheduler": Schedulers(self.schedulers),
        }


@dataclass
class Schedulers:
    """``Stateful`` view of several schedulers, by position."""

    schedulers: list[LambdaLR]

    def state_dict(self) -> dict[str, Any]:
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, scheduler in enumerate(self.schedulers):
            scheduler.load_state_dict(state[str(i)])
