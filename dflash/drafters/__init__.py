"""Drafter families, one module each: ``drafter.family`` picks one by its ``name``.

Each module defines ``DRAFTER = Family(name=..., ...)`` and documents it in its docstring's
first paragraph, which ``docs/configuration.md`` shows; ``dflash.model.families`` finds it. The
model code stays in ``dflash.model``: a family module names how to build, start and load its
drafter, and the drafter it builds exports itself (``save_pretrained``, ``config_json``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from dflash.config.schema import DrafterConfig
    from dflash.model.imported import Checkpoint


@dataclass(frozen=True)
class Family:
    """One kind of drafter, from training to its export."""

    name: str
    architecture: str
    """``architectures[0]`` of its exports' ``config.json``, the class serving stacks load."""
    build: Callable[[DrafterConfig, nn.Module, Any, int], nn.Module]
    """``(drafter params, target, tokenizer, seed)``: a freshly initialised drafter (seeded,
    global RNG untouched) on the target's device, masking with the tokenizer's mask token."""
    start_from: Callable[[DrafterConfig, Checkpoint, int, str | None, nn.Module], nn.Module]
    """``(drafter params, checkpoint, target depth, mask token, target)``: the drafter holding a
    checked checkpoint's weights (the params size what the checkpoint lacks)."""
    load: Callable[[Path, nn.Module], nn.Module]
    """``(export directory, target)``: the drafter an export of this family holds."""


def from_target_options(d: DrafterConfig, tokenizer: Any, seed: int) -> dict[str, Any]:
    """The drafter params and tokenizer facts every family's ``from_target`` takes, named once
    so that families seeded alike start from the same DFlash weights."""
    return dict(
        block_size=d.block_size, num_hidden_layers=d.num_hidden_layers,
        num_target_features=d.num_target_features, mask_token_id=tokenizer.mask_token_id,
        mask_token=tokenizer.mask_token, seed=seed, layer_types=d.layer_types,
        sliding_window=d.sliding_window, causal=d.causal,
    )  # fmt: skip
