"""``dflash2``: DFlash 2 (z-lab with Inco AI), the DFlash drafter with a two-tap block-local
dynamic convolution around every sublayer and a low-rank candidate selector that rescores the
head's top-K per slot given the token before it; its blocks are the selector's greedy walk from
the anchor. Exported as ``DFlash2DraftModel``, which vLLM and SGLang serve."""

from __future__ import annotations

from typing import Any

from torch import nn

from dflash.config.schema import DrafterConfig
from dflash.drafters import Family, from_target_options
from dflash.errors import ConfigError
from dflash.model.dflash2_drafter import (
    ARCHITECTURE,
    DFlash2Drafter,
    DFlash2Sizes,
    dflash2_config,
)
from dflash.model.imported import Checkpoint, checkpoint_weights


def sizes(d: DrafterConfig) -> DFlash2Sizes:
    """The four DFlash 2 sizes of the drafter params."""
    return DFlash2Sizes(
        conv_kernel_size=d.conv_kernel_size,
        conv_group_size=d.conv_group_size,
        selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k,
    )


def check_sizes(d: DrafterConfig, hidden_size: int, vocab_size: int) -> None:
    """A ConfigError (exit 2) naming the first DFlash 2 size that cannot work on a target of
    ``hidden_size`` channels and ``vocab_size`` tokens."""
    rules = (
        ("conv_group_size", hidden_size % d.conv_group_size == 0,
         f"does not divide the target's hidden size {hidden_size}"),
        ("conv_kernel_size", 1 <= d.conv_kernel_size <= d.block_size,
         f"is not in [1, drafter.block_size = {d.block_size}]"),
        ("selector_top_k", d.selector_top_k <= vocab_size,
         f"is more candidates than the vocabulary's {vocab_size} tokens"),
    )  # fmt: skip
    for key, ok, why in rules:
        if not ok:
            raise ConfigError(f"drafter.{key} = {getattr(d, key)} {why}")


def build(d: DrafterConfig, target: nn.Module, tokenizer: Any, seed: int) -> DFlash2Drafter:
    """The DFlash drafter of this seed made DFlash 2: convs the identity, pair term 0."""
    vocab, hidden = target.get_input_embeddings().weight.shape
    check_sizes(d, hidden, vocab)
    return DFlash2Drafter.from_target(
        target, sizes=sizes(d), **from_target_options(d, tokenizer, seed)
    )


def start_from(
    d: DrafterConfig, checkpoint: Checkpoint, depth: int, mask_token: str | None, target: nn.Module
) -> DFlash2Drafter:
    """A DFlash 2 checkpoint's drafter, every weight loaded; or a DFlash one upgraded with the
    params' sizes (convs the identity, pair term 0), which computes that drafter's logits."""
    config = checkpoint.drafter_config(depth, mask_token)
    check_sizes(d, config.hidden_size, config.vocab_size)
    if checkpoint.dflash2 is not None:
        return DFlash2Drafter.from_weights(config, checkpoint_weights(checkpoint), target)
    upgraded = dflash2_config(config, sizes(d))
    return DFlash2Drafter.from_dflash(upgraded, checkpoint_weights(checkpoint), target)


DRAFTER = Family(
    name="dflash2",
    architecture=ARCHITECTURE,
    build=build,
    start_from=start_from,
    load=DFlash2Drafter.from_pretrained,
)
