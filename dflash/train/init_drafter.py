"""Starting training from an existing drafter (``drafter.init_from``): its geometry against the
params and against the target, checked before any rank starts and again in each.

The checkpoint decides the drafter's shape. A ``drafter.*`` param set to another value is an
error naming both; one left null follows the checkpoint. ``block_size`` is never null: tokenize
and plan use it before training, so it must already be the checkpoint's. Where each value came
from is recorded for ``dflash report``.

A DFlash 2 checkpoint starts only ``drafter.family: dflash2``, and its four DFlash 2 sizes are
the drafter's: a ``drafter.*`` size set to another value is an error naming both. A DFlash
checkpoint starts either family; ``dflash2`` upgrades it with the params' sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from dflash.config.schema import DrafterConfig
from dflash.drafters.dflash2 import check_sizes
from dflash.drafters.dflash2 import sizes as sizes_of
from dflash.errors import ConfigError
from dflash.model.families import family
from dflash.model.imported import Checkpoint, check_finite, check_weights, read_checkpoint
from dflash.model.layer_ids import target_layer_ids


@dataclass(frozen=True)
class TargetShape:
    """What the checkpoint is checked against: the target's and the tokenizer's."""

    depth: int
    hidden_size: int
    vocab_size: int
    mask_token_id: int | None
    mask_token: str | None


def provenance(d: DrafterConfig, checkpoint: Checkpoint | None) -> dict[str, str]:
    """Each geometry param's value and where it came from; raises for a param that disagrees
    with the checkpoint, naming both values."""
    if checkpoint is None:
        keys = ("block_size", "num_hidden_layers", "num_target_features")
        return {key: f"{getattr(d, key)} (params)" for key in keys}
    own = {
        "block_size": checkpoint.block_size,
        "num_hidden_layers": checkpoint.layers["num_hidden_layers"],
        "num_target_features": len(checkpoint.target_layer_ids),
    }
    if checkpoint.mask_token is not None:
        own["mask_token"] = checkpoint.mask_token
    sources = {}
    for key, value in own.items():
        param = getattr(d, key)
        if param is not None and param != value:
            fix = "" if key == "block_size" else ", or null to follow it"
            raise checkpoint.fail(
                f"drafter.{key} = {param!r} but the checkpoint has {value!r}: set it to "
                f"{value!r}{fix}"
            )
        sources[key] = f"{value} ({'checkpoint' if param is None else 'params = checkpoint'})"
    sources |= _dflash2_sources(d, checkpoint)
    sources["target_layer_ids"] = f"{checkpoint.target_layer_ids} (checkpoint)"
    sources["mask_token_id"] = f"{checkpoint.mask_token_id} (checkpoint)"
    return sources


def _dflash2_sources(d: DrafterConfig, checkpoint: Checkpoint) -> dict[str, str]:
    """The DFlash 2 sizes' provenance; raises for a DFlash 2 checkpoint under another family or
    a size that disagrees with it."""
    sizes = checkpoint.dflash2
    if sizes is not None and d.family != "dflash2":
        raise checkpoint.fail(
            f"a DFlash 2 drafter, and drafter.family = {d.family!r}: set drafter.family: dflash2"
        )
    if d.family != "dflash2":
        return {}
    if sizes is None:  # an upgrade: the params size it, for the checkpoint's target
        check_sizes(d, checkpoint.layers["hidden_size"], checkpoint.layers["vocab_size"])
        return {key: f"{value} (params)" for key, value in asdict(sizes_of(d)).items()}
    for key, value in sizes.items():
        if getattr(d, key) != value:
            raise checkpoint.fail(
                f"drafter.{key} = {getattr(d, key)!r} but the checkpoint has {value!r}: set it "
                f"to {value!r}"
            )
    return {key: f"{value} (params = checkpoint)" for key, value in sizes.items()}


def check_target(checkpoint: Checkpoint, target: TargetShape) -> None:
    """Raise naming every difference between the checkpoint and this target and tokenizer."""
    c, t, ids = checkpoint, target, checkpoint.target_layer_ids
    problems = []
    if c.layers["hidden_size"] != t.hidden_size:
        problems.append(f"hidden size {c.layers['hidden_size']}, the target's is {t.hidden_size}")
    if c.layers["vocab_size"] != t.vocab_size:
        problems.append(f"vocabulary {c.layers['vocab_size']}, the target's is {t.vocab_size}")
    if min(ids) < 0 or max(ids) >= t.depth:
        problems.append(f"target_layer_ids {ids}, beyond the target's {t.depth} layers")
    if c.num_target_layers is not None and c.num_target_layers != t.depth:
        problems.append(f"a {c.num_target_layers}-layer target, this one has {t.depth}")
    if t.mask_token_id != c.mask_token_id:
        problems.append(
            f"mask token id {c.mask_token_id}, the tokenizer's mask token {t.mask_token!r} has "
            f"id {t.mask_token_id} (set drafter.mask_token to the checkpoint's token and rerun "
            "the tokenizer stage)"
        )
    if problems:
        raise checkpoint.fail("made for another target; it has " + "; ".join(problems))


def target_shape(target_config: Any, tokenizer: Any) -> TargetShape:
    """The ``TargetShape`` of a target's (text) config and the run's tokenizer."""
    text = target_config.get_text_config()
    return TargetShape(
        text.num_hidden_layers,
        text.hidden_size,
        text.vocab_size,
        tokenizer.mask_token_id,
        tokenizer.mask_token,
    )


def checked_checkpoint(
    d: DrafterConfig, path: Path | None, target: TargetShape, values: bool = True
) -> tuple[Checkpoint | None, dict[str, str]]:
    """The checkpoint at ``path`` (None from scratch), checked against the params and the target,
    and each param's provenance; with ``values``, every weight read and found finite too."""
    if path is None:
        return None, provenance(d, None)
    if not path.is_dir():
        raise ConfigError(f"drafter.init_from = {str(path)!r}: no such directory")
    checkpoint = read_checkpoint(path)
    sources = provenance(d, checkpoint)
    check_target(checkpoint, target)
    check_weights(checkpoint, target.depth)
    if values:
        check_finite(checkpoint)
    return checkpoint, sources


def build_drafter(
    d: DrafterConfig, init: Path | None, target: nn.Module, tokenizer: Any, seed: int
) -> tuple[nn.Module, dict[str, str]]:
    """The drafter of ``drafter.family`` training starts from: ``init``'s weights as stored, or
    a seeded random one; and where its geometry came from (``provenance``, plus ``init_from``)."""
    shape = target_shape(target.config, tokenizer)
    checkpoint, sources = checked_checkpoint(d, init, shape, values=False)  # read just below
    kind = family(d.family)
    if checkpoint is None:
        return kind.build(d, target, tokenizer, seed), sources
    drafter = kind.start_from(d, checkpoint, shape.depth, tokenizer.mask_token, target)
    return drafter, sources | {"init_from": f"{checkpoint.path} ({checkpoint.format})"}


def tapped_layers(d: DrafterConfig, init: Path | None, depth: int) -> list[int]:
    """The target layers the drafter reads: the checkpoint's, or spread over ``depth``."""
    if init is None:
        return target_layer_ids(depth, d.num_target_features)
    return read_checkpoint(init).target_layer_ids
