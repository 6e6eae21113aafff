"""What serving stacks read from a drafter's ``config.json``, and the atomic export itself.

z-lab's reference ``DFlashDraftModel`` builds a ``Qwen3Config`` from the file and reads
``dflash_config.{target_layer_ids, mask_token_id}`` and ``block_size``. SGLang
(``srt/models/dflash.py``) and vLLM (``qwen3_dflash.py``) size the draft's rope cache from
``max_position_embeddings`` and read the rope parameters (transformers 4 writes ``rope_theta``
and ``rope_scaling``, transformers 5 ``rope_parameters``) and the dtype (``torch_dtype`` in 4,
``dtype`` in 5). vLLM takes the target layers to tap from ``eagle_aux_hidden_state_layer_ids``;
its ids count the embedding as layer 0, so they are DFlash's ``target_layer_ids`` + 1 (newer
vLLM derives them from ``dflash_config`` the same way; older builds read only this key).
SGLang finds the mask token by its string, ``dflash_config.mask_token``, and assumes ``<|MASK|>``
without it. z-lab's documented ``AutoModel`` path with ``trust_remote_code=True`` needs
``auto_map`` and the modelling file it names (:mod:`dflash.model.shipped`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflash.fileio import atomic_dir
from dflash.model import shipped
from dflash.model.card import model_card
from dflash.model.hf_files import MODEL_CARD, REMOTE_CODE
from dflash.model.layer_ids import engine_layer_ids
from dflash.model.shipped import DFlashDraftConfig
from dflash.model.target_dir import resolve_target_path

logger = logging.getLogger(__name__)

DRAFTER_KEYS = (
    "block_size",
    "num_hidden_layers",
    "num_target_layers",
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
)
"""The drafter's own top-level ``config.json`` keys besides ``rope_theta``, in written order."""
DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "mask_token", "causal")
"""The keys under ``dflash_config``; ``mask_token`` and ``causal`` only where the run sets them."""
DFLASH2_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)
"""The keys under ``dflash_config`` of a DFlash 2 drafter only, after :data:`DFLASH_KEYS`: its
four sizes, and the served unary transform where a checkpoint sets it."""
DEFAULT_MAX_POSITIONS = 32768
"""Rope cache size SGLang assumes when ``max_position_embeddings`` is missing."""


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def rope_keys(target_config: Any, theta: float) -> dict:
    """Rope parameters in the transformers 4 and 5 spellings, from the target's config.

    ``rope_scaling`` is null for plain rope, as in the Qwen3 configs the loaders were built on.
    """
    params = dict(
        getattr(target_config, "rope_parameters", None)
        or getattr(target_config, "rope_scaling", None)
        or {}
    )
    params.setdefault("rope_type", params.pop("type", "default"))  # transformers 4 wrote "type"
    params["rope_theta"] = theta
    plain = params["rope_type"] == "default"
    scaling = None if plain else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": params}


def config_json(
    config: DFlashDraftConfig, target_config: Any = None, dtype: torch.dtype | None = None
) -> dict:
    """The Hugging Face style ``config.json`` of docs/design.md, plus what serving stacks read.

    The constant Qwen3 keys let the public DFlash inference code read it as a Qwen3 config;
    the parameter names in ``model.safetensors`` follow that code's layout too. Given the
    target's config and the weights' dtype it also carries what vLLM and SGLang size the
    draft by (:func:`serving_keys`).
    """
    return {
        "architectures": [shipped.DFlashDraftModel.__name__],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "attention_bias": False,
        **{key: getattr(config, key) for key in DRAFTER_KEYS},
        "rope_theta": config.theta,
        **serving_keys(config, target_config, dtype),
        "dflash_config": {
            key: config.dflash[key] for key in DFLASH_KEYS + DFLASH2_KEYS if key in config.dflash
        },
    }


def read_config(data: dict) -> DFlashDraftConfig:
    """The config a drafter was built with, from its ``config.json``; serving keys are left out."""
    dflash = data.get("dflash_config", {})
    missing = [key for key in (*DRAFTER_KEYS, "rope_theta") if key not in data]
    missing += [key for key in DFLASH_KEYS[:2] if key not in dflash]
    if missing:
        raise ValueError(f"drafter config.json lacks {sorted(missing)}")
    windows = {}
    if data.get("sliding_window") is not None:
        windows = {key: data[key] for key in ("layer_types", "sliding_window")}
    return DFlashDraftConfig(
        **{key: data[key] for key in DRAFTER_KEYS},
        **windows,
        use_sliding_window=bool(windows),
        rope_theta=data["rope_theta"],
        dflash_config={
            key: dflash[key] for key in DFLASH_KEYS + DFLASH2_KEYS if dflash.get(key) is not None
        },
    )


def serving_keys(config: Any, target_config: Any = None, dtype: torch.dtype | None = None) -> dict:
    """The keys of a drafter's ``config.json`` beyond docs/design.md's, for serving."""
    n = config.num_hidden_layers
    max_positions = getattr(target_config, "max_position_embeddings", None)
    return {
        "max_position_embeddings": max_positions or DEFAULT_MAX_POSITIONS,
        **rope_keys(target_config, config.theta),
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
        "eagle_aux_hidden_state_layer_ids": engine_layer_ids(config.target_layer_ids),
        "auto_map": auto_map(),
        "layer_types": list(getattr(config, "layer_types", None) or ["full_attention"] * n),
        "use_sliding_window": getattr(config, "sliding_window", None) is not None,
        "sliding_window": getattr(config, "sliding_window", None),
        "max_window_layers": n,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": False,
        "use_cache": True,
        **{
            key: getattr(target_config, key, None)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        },
    }


def auto_map() -> dict[str, str]:
    """Where ``AutoConfig`` and ``AutoModel`` find the classes of the shipped ``dflash.py``."""
    module = Path(REMOTE_CODE).stem
    return {
        "AutoConfig": f"{module}.{shipped.DFlashDraftConfig.__name__}",
        "AutoModel": f"{module}.{shipped.DFlashDraftModel.__name__}",
    }


def export_dtype(setting: str, target_dir: Path) -> torch.dtype | None:
    """``export.dtype`` as a torch dtype; ``auto`` is the dtype the target's own config serves
    in (bf16 for a bf16 checkpoint), read from its files: the loaded target runs in fp32 on CPU.
    None when the config names none (the export then keeps the run's dtype)."""
    if setting != "auto":
        return getattr(torch, setting)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_target_path(target_dir), local_files_only=True)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def export_run(
    drafter: Any,
    config: Any,
    out: Path,
    target_dir: Path,
    params: dict,
    target_config: Any,
    training: dict,
    weights: dict | None = None,
) -> None:
    """A training run's export to ``out``: in ``export.dtype``, with a model card of its
    ``params`` (by section) and ``training``'s figures; ``weights`` as for ``export_drafter``."""
    dtype = export_dtype(config.export.dtype, target_dir)
    dtype = dtype or drafter.borrowed.embed_tokens.weight.dtype
    card = model_card(
        drafter.config_json(target_config, dtype),
        resolve_target_path(target_dir),
        params,
        training,
    )
    export_drafter(drafter, out, target_config, dtype, card, weights)


def loader_notes(config: Any) -> list[str]:
    """Warnings for loaders that would tap the wrong target layers from this config."""
    n_features, n_layers = len(config.target_layer_ids), config.num_hidden_layers
    if n_features == n_layers:
        return []
    return [
        f"{n_features} target features but {n_layers} drafter layers: loaders that derive the "
        "tapped layers from the drafter's depth need target_layer_ids: z-lab DFlashDraftModel "
        "and SGLang read dflash_config.target_layer_ids (else build_target_layer_ids("
        "num_target_layers, num_hidden_layers)); vLLM reads eagle_aux_hidden_state_layer_ids "
        "(older builds otherwise size fc by num_hidden_layers); both are written here"
    ]


def export_drafter(
    drafter: Any,
    out: Path,
    target_config: Any = None,
    dtype: torch.dtype | None = None,
    card: str | None = None,
    weights: dict | None = None,
) -> None:
    """Write the Hugging Face style drafter directory whole or not at all, and say what to check.

    ``weights`` are the drafter's whole parameters when it is sharded (gathered beforehand).
    """
    with atomic_dir(out) as tmp:
        drafter.save_pretrained(tmp, target_config, dtype, weights)
        if card is not None:
            (tmp / MODEL_CARD).write_text(card)
    for note in loader_notes(drafter.config):
        logger.info(f"{out}: {note}")
