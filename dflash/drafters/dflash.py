"""``dflash``: the DFlash drafter (z-lab), a few Qwen3 layers that draft a block in one pass,
conditioned on the target's hidden states by KV injection; exported as ``DFlashDraftModel``,
which vLLM, SGLang and z-lab's code serve."""

from __future__ import annotations

from typing import Any

from torch import nn

from dflash.config.schema import DrafterConfig
from dflash.drafters import Family, from_target_options
from dflash.model.drafter import DFlashDrafter
from dflash.model.imported import Checkpoint, checkpoint_weights
from dflash.model.shipped import DFlashDraftModel


def build(d: DrafterConfig, target: nn.Module, tokenizer: Any, seed: int) -> DFlashDrafter:
    return DFlashDrafter.from_target(target, **from_target_options(d, tokenizer, seed))


def start_from(
    d: DrafterConfig, checkpoint: Checkpoint, depth: int, mask_token: str | None, target: nn.Module
) -> DFlashDrafter:
    config = checkpoint.drafter_config(depth, mask_token)
    return DFlashDrafter.from_weights(config, checkpoint_weights(checkpoint), target)


DRAFTER = Family(
    name="dflash",
    architecture=DFlashDraftModel.__name__,
    build=build,
    start_from=start_from,
    load=DFlashDrafter.from_pretrained,
)
