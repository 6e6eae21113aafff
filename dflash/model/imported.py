"""An existing DFlash drafter read as this project's: z-lab's, speculators', or an export.

z-lab's format is the one :mod:`dflash.model.export` writes (docs/design.md, "Drafter
export"): a Qwen3 ``config.json`` whose ``dflash_config`` holds ``target_layer_ids`` and
``mask_token_id`` (``block_size`` at the top level, or inside it in newer files), and weights
``layers.*``, ``fc``, ``hidden_norm`` and ``norm`` under the names :mod:`dflash.model.shipped`
gives them. speculators' ``DFlashDraftModel`` keeps the same weight names, but its
``config.json`` nests the layer config under ``transformer_layer_config`` and names the
tapped layers ``aux_hidden_state_layer_ids``, counted from the embedding (vLLM's ids: DFlash's
``target_layer_ids`` + 1); it may also hold copies of the target's embedding and head, which
the drafter borrows instead. Anything the trainer's drafter would compute differently (biased
projections, sliding-window layers, scaled rope, a reduced draft vocabulary) is refused, so an
import is exact or it is an error.

A DFlash 2 checkpoint is one of these that names the four DFlash 2 sizes (z-lab: in
``dflash_config``, else at the top; speculators: ``speculators_model_type: dflash2``, the sizes at
the top with speculators' defaults) and holds the conv and selector weights of
:mod:`dflash.model.dflash2_weights`, in any spelling ``import_weights`` reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from annotated_types import Ge
from safetensors import SafetensorError, safe_open
from torch import Tensor
from transformers import AutoConfig

from dflash.config.schema import DrafterConfig
from dflash.errors import ConfigError
from dflash.model import hf_files, shipped
from dflash.model.dflash2_weights import dflash2_shapes, import_weights
from dflash.model.layer_ids import drafter_layer_ids
from dflash.model.layer_ids import target_layer_ids as spread_layer_ids
from dflash.model.shipped import DFlashDraftConfig

KEY = "drafter.init_from"

SPECULATORS_TYPE = "dflash"
"""``speculators_model_type`` of a speculators DFlash checkpoint."""
SPECULATORS_DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                       "selector_top_k": 16}  # fmt: skip
"""The DFlash 2 sizes and the defaults speculators' ``dflash2`` config gives them."""
SERVED_AS_TRAINED = {"output_multiplier": (1, 1.0), "final_logit_softcapping": (0, 0.0),
                     "input_embedding_scale": (1, 1.0)}  # fmt: skip
"""z-lab's logit and embedding transforms, and the values the trainer's drafter computes with."""
SPECULATORS_DEFAULT_BLOCK = 8
"""The block size speculators' config assumes when its file names none."""
MIN_BLOCK = next(m.ge for m in DrafterConfig.model_fields["block_size"].metadata
                 if isinstance(m, Ge))  # fmt: skip
"""The smallest block a drafter trains with (``drafter.block_size``'s bound): the anchor and
at least one drafted token."""
JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}  # fmt: skip
TARGET_OWNED = frozenset(
    {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
)
"""Weights a speculators checkpoint may carry that are the target's: the drafter borrows them."""
VOCAB_MAPS = frozenset({"t2d", "d2t"})
"""speculators' draft-vocabulary maps: present (even all-true) only beside a full vocabulary."""


@dataclass(frozen=True)
class Checkpoint:
    """A drafter checkpoint directory and what it says of the drafter."""

    path: Path
    format: str
    """``z-lab`` (also this project's exports) or ``speculators``."""
    layers: dict[str, Any]
    """The layer geometry (sizes, heads, norm eps, vocabulary, depth) and ``rope_theta``."""
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    mask_token: str | None
    num_target_layers: int | None
    """The target's depth, where the file records it."""
    dflash2: dict[str, int] | None = None
    """A DFlash 2 checkpoint's four sizes (:data:`SPECULATORS_DFLASH2`'s keys); None for DFlash."""

    def fail(self, why: str) -> ConfigError:
        return ConfigError(f"{KEY} = {str(self.path)!r} ({self.format}): {why}")

    def drafter_config(self, depth: int, mask_token: str | None) -> DFlashDraftConfig:
        """The trainer's config of this drafter, for a target of ``depth`` layers."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}
        if (self.mask_token or mask_token) is not None:
            dflash["mask_token"] = self.mask_token or mask_token
        dflash |= self.dflash2 or {}
        return DFlashDraftConfig(
            **self.layers,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers or depth,
            dflash_config=dflash,
        )


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path`` from its ``config.json`` (no weights are read)."""
    path = Path(path)
    where = f"{KEY} = {str(path)!r}"
    if not (path / hf_files.CONFIG).is_file():
        raise ConfigError(f"{where}: no {hf_files.CONFIG} there (a DFlash checkpoint directory)")
    try:
        data = json.loads((path / hf_files.CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: unreadable {hf_files.CONFIG} ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {hf_files.CONFIG} holds {JSON_KINDS[type(data)]}, not the "
                          "JSON object of a model config")  # fmt: skip
    if data.get("speculators_model_type") is not None:
        return _speculators(path, data)
    if "dflash_config" in data:
        return _zlab(path, data)
    raise ConfigError(
        f"{where}: {hf_files.CONFIG} is neither z-lab's (dflash_config) nor speculators' "
        "(speculators_model_type: dflash) DFlash format"
    )


def _object(where: str, data: dict, key: str) -> dict:
    """``data[key]``, a JSON object (absent or null: an empty one)."""
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{where}: {hf_files.CONFIG} has {key} = {value!r}, not an object")
    return value or {}


BLOCK_WHY = "a block is the anchor and at least one drafted token, "


def _whole(where: str, key: str, value: Any, least: int = 0, why: str = "") -> int:
    """``value`` of ``key``, refused unless a whole number of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: {hf_files.CONFIG} has {key} = {value!r}, which is invalid: "
                          f"{why}a whole number >= {least}")  # fmt: skip
    return value


def _ids(where: str, key: str, value: Any) -> list[int]:
    """``value`` of ``key`` as layer ids: a non-empty list of whole numbers."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {hf_files.CONFIG} has {key} = {value!r}, which is invalid: "
                          "a non-empty list of layer ids")  # fmt: skip
    return [_whole(where, key, i) for i in value]


def _layers(path: Path, fmt: str, raw: dict) -> dict[str, Any]:
    """The layer geometry of a Hugging Face layer config, refusing what the drafter lacks."""
    fields = {k: v for k, v in raw.items() if k not in ("dflash_config", "auto_map")}
    where = f"{KEY} = {str(path)!r} ({fmt})"
    try:
        config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: its layer config does not load ({err})") from None
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
                or {})  # fmt: skip
    unsupported = {
        "attention_bias": getattr(config, "attention_bias", False),
        "hidden_act": getattr(config, "hidden_act", "silu"),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
        "layer_types": sorted(set(getattr(config, "layer_types", None) or ["full_attention"])),
    }
    allowed = {"attention_bias": False, "hidden_act": "silu", "rope_type": "default",
               "layer_types": ["full_attention"]}  # fmt: skip
    for key, value in unsupported.items():
        if value != allowed[key]:
            raise ConfigError(
                f"{where}: {key} = {value!r}, the trainer's drafter has {allowed[key]!r} only"
            )
    heads = config.num_attention_heads
    layers = {
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
        "num_hidden_layers": config.num_hidden_layers,
    }
    return layers | {"rope_theta": shipped.rope_theta(config)}


def _zlab(path: Path, data: dict) -> Checkpoint:
    where = f"{KEY} = {str(path)!r} (z-lab)"
    dflash = _object(where, data, "dflash_config")
    key = "block_size" if data.get("block_size") is not None else "dflash_config.block_size"
    block = data["block_size"] if key == "block_size" else dflash.get("block_size")
    if block is None or dflash.get("mask_token_id") is None:
        missing = "block_size" if block is None else "dflash_config.mask_token_id"
        raise ConfigError(f"{where}: {hf_files.CONFIG} has no {missing}")
    block = _whole(where, key, block, MIN_BLOCK, BLOCK_WHY)
    mask = _whole(where, "dflash_config.mask_token_id", dflash["mask_token_id"])
    layers = _layers(path, "z-lab", data)
    depth = data.get("num_target_layers")
    depth = None if depth is None else _whole(where, "num_target_layers", depth, 1)
    ids = dflash.get("target_layer_ids")
    if ids is None and depth is None:
        raise ConfigError(f"{where}: names neither dflash_config.target_layer_ids nor "
                          "num_target_layers to derive them from")  # fmt: skip
    if ids is None:  # z-lab's reference spreads one tapped layer per drafter layer
        ids = spread_layer_ids(depth, layers["num_hidden_layers"])
    ids = _ids(where, "dflash_config.target_layer_ids", ids)
    sizes = _zlab_dflash2(where, data, dflash)
    return Checkpoint(
        path, "z-lab", layers, block, ids, mask, dflash.get("mask_token"), depth, sizes
    )


def _zlab_dflash2(where: str, data: dict, dflash: dict) -> dict[str, int] | None:
    """The DFlash 2 sizes of a z-lab config (``dflash_config`` first, as the engines read
    them), None where it names none; one naming some but not all, or a logit or embedding
    transform the trainer's drafter lacks, is refused."""
    found = {k: dflash.get(k, data.get(k)) for k in SPECULATORS_DFLASH2}
    if all(v is None for v in found.values()):
        return None
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise ConfigError(f"{where}: {hf_files.CONFIG} names some DFlash 2 sizes but not "
                          f"dflash_config.{', dflash_config.'.join(missing)}")  # fmt: skip
    for key, plain in SERVED_AS_TRAINED.items():
        value = dflash.get(key, data.get(key))
        if value is not None and value not in plain:
            raise ConfigError(f"{where}: {key} = {value!r}; the trainer's DFlash 2 drafter has "
                              f"{plain[0]!r} only")  # fmt: skip
    return {k: _whole(where, f"dflash_config.{k}", v, 1) for k, v in found.items()}


def _speculators(path: Path, data: dict) -> Checkpoint:
    where = f"{KEY} = {str(path)!r} (speculators)"
    kind = data.get("speculators_model_type")
    if kind not in (SPECULATORS_TYPE, "dflash2"):
        raise ConfigError(f"{where}: speculators_model_type = {kind!r}, not {SPECULATORS_TYPE!r} "
                          "or 'dflash2'")  # fmt: skip
    layers = _layers(path, "speculators", _object(where, data, "transformer_layer_config"))
    variants = {
        "projector_type": (data.get("projector_type", "dflash"), "dflash"),
        "sample_from_anchor": (bool(data.get("sample_from_anchor")), False),
        "shift_label": (bool(data.get("shift_label")), False),
        "draft_vocab_size": (data.get("draft_vocab_size", layers["vocab_size"]),
                             layers["vocab_size"]),
    }  # fmt: skip
    for key, (value, plain) in variants.items():
        if value != plain:
            raise ConfigError(
                f"{where}: {key} = {value!r}; the DFlash drafter trained here has {plain!r} "
                "(the target's whole vocabulary, no shift)"
            )
    aux, mask = data.get("aux_hidden_state_layer_ids"), data.get("mask_token_id")
    if aux is None or mask is None:
        missing = "aux_hidden_state_layer_ids" if aux is None else "mask_token_id"
        raise ConfigError(f"{where}: {hf_files.CONFIG} has no {missing}")
    aux, mask = _ids(where, "aux_hidden_state_layer_ids", aux), _whole(where, "mask_token_id", mask)
    if min(aux) < 1:
        raise ConfigError(f"{where}: aux_hidden_state_layer_ids {aux} tap the embedding (id 0), "
                          "which a DFlash drafter never fuses")  # fmt: skip
    block = data.get("block_size")
    if block is None:
        block = SPECULATORS_DEFAULT_BLOCK
    block = _whole(where, "block_size", block, MIN_BLOCK, BLOCK_WHY)
    ids = drafter_layer_ids(aux)  # counted from the embedding, as vLLM counts
    sizes = None
    if kind == "dflash2":
        sizes = {k: _whole(where, k, data.get(k, v), 1) for k, v in SPECULATORS_DFLASH2.items()}
    return Checkpoint(path, "speculators", layers, block, ids, mask, None, None, sizes)


def weight_files(checkpoint: Checkpoint) -> list[Path]:
    """The safetensors files of a checkpoint: one, or those its index names."""
    single, index = checkpoint.path / hf_files.WEIGHTS, checkpoint.path / hf_files.WEIGHTS_INDEX
    if single.is_file():
        return [single]
    if not index.is_file():
        raise checkpoint.fail(f"no {hf_files.WEIGHTS} or {hf_files.WEIGHTS_INDEX} there")
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise checkpoint.fail(
            f"{index} is no safetensors index (a JSON object whose weight_map maps each weight "
            f"to its file): {type(err).__name__} {err}"
        ) from None
    return [checkpoint.path / name for name in names]


def _drafter_name(name: str) -> bool:
    return name not in TARGET_OWNED and name not in VOCAB_MAPS


def _named(checkpoint: Checkpoint, stored: dict[str, Any]) -> dict[str, Any]:
    """A DFlash 2 checkpoint's ``stored`` entries under the drafter's names (``import_weights``'s
    spellings); a DFlash one's as they are."""
    if checkpoint.dflash2 is None:
        return stored
    try:
        return import_weights(stored)
    except ValueError as err:
        raise checkpoint.fail(f"its weights name one twice: {err}") from None


@contextmanager
def _opened(checkpoint: Checkpoint, file: Path) -> Iterator[Any]:
    """``file`` opened with ``safe_open``; one that is missing, cut short or no safetensors
    file at all is the checkpoint's error, naming it."""
    try:
        with safe_open(str(file), "pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise checkpoint.fail(f"{file} is no readable safetensors file ({err})") from None


def check_weights(checkpoint: Checkpoint, depth: int) -> None:
    """Every drafter weight present with its shape, and no other (reads headers only)."""
    shapes = {}
    for file in weight_files(checkpoint):
        with _opened(checkpoint, file) as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if _drafter_name(k)}
    shapes = _named(checkpoint, shapes)
    config = checkpoint.drafter_config(depth, None)
    with torch.device("meta"):
        model = shipped.DFlashDraftModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if checkpoint.dflash2 is not None:
        expected |= dflash2_shapes(config)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})" for k in expected.keys() & shapes.keys()
             if shapes[k] != expected[k]]  # fmt: skip
    for what, names in (("lacks", missing), ("has unknown weights", extra), ("has", wrong)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise checkpoint.fail(f"its weights do not fit its {hf_files.CONFIG}: {what} {shown}")


def _tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, Tensor]]:
    """The drafter's own weights one by one, as stored; a weight holding a NaN or an infinity
    is refused by name: training from it would only spread it, and an export would ship it."""
    for file in weight_files(checkpoint):
        with _opened(checkpoint, file) as f:
            for name in (k for k in f.keys() if _drafter_name(k)):
                tensor = f.get_tensor(name)
                bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
                if bad:
                    raise checkpoint.fail(
                        f"weight {name} in {file} holds {bad} NaN or infinite value(s) of "
                        f"{tensor.numel()}: the checkpoint is corrupt or its training diverged"
                    )
                yield name, tensor


def check_finite(checkpoint: Checkpoint) -> None:
    """Every drafter weight finite (read one at a time, none kept)."""
    for _ in _tensors(checkpoint):
        pass


def checkpoint_weights(checkpoint: Checkpoint) -> dict[str, Tensor]:
    """The drafter's own weights, as stored and finite (the target's copies are left out),
    under the drafter's names."""
    return _named(checkpoint, dict(_tensors(checkpoint)))
