"""The drafter and its optimizer as checkpointable parts, whether replicated or sharded.

``torch.distributed.checkpoint.state_dict`` names parameters and optimizer state by their
fully qualified names and keeps FSDP2 shards as DTensors, so one part works for a plain
module, a DDP replica and a ``fully_shard`` drafter alike, and each rank saves and loads
only the shards it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class ModelPart:
    """``Stateful`` view of a module's parameters (the borrowed target weights are not in it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerPart:
    """``Stateful`` view of an optimizer's state, keyed by parameter names, not positions."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    ) -> None:
        """``optimizer``: one, or several over disjoint parameters (saved as one state)."""
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded parameters on CPU, gathered once (a collective: every rank calls
    it); rank 0 gets them, the other ranks an empty dict when sharded."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
