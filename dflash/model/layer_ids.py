"""Which target layers the drafter reads, how wide their features are, how engines number
them, and the params check that they exist.

Kept apart from the feature code (and its attention kernels) so that the target stage can
check ``drafter.num_target_features`` against the target's depth without depending on them.
"""

from __future__ import annotations

from dflash.errors import ConfigError

EMBEDDING_OFFSET = 1
"""Engines and Hugging Face count the embedding as state 0: the output of decoder layer ``i``
(the drafter's id) is their ``i + 1``. The exported drafter's code (:mod:`dflash.model.shipped`)
ships without this project and drops state 0 itself."""


def engine_layer_ids(layer_ids: list[int]) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` a server needs for the drafter's ``layer_ids``.

    vLLM records aux state ``j`` before decoder layer ``j`` runs (its input, the residual
    stream: the output of layer ``j - 1``, Hugging Face's ``hidden_states[j]``), so the output
    of layer ``i`` that the drafter reads is engine id ``i + 1``.
    """
    return [i + EMBEDDING_OFFSET for i in layer_ids]


def drafter_layer_ids(engine_ids: list[int]) -> list[int]:
    """The drafter's layer ids of a checkpoint's engine-counted ``aux_hidden_state_layer_ids``."""
    return [i - EMBEDDING_OFFSET for i in engine_ids]


def target_layer_ids(num_layers: int, n: int) -> list[int]:
    """Indices of the target layers whose outputs are fused, ``round(1 + i*(L-4)/(n-1))``.

    With a single feature (``n == 1``) the rule is undefined; the middle layer ``L // 2`` is the
    natural single view (the choice of the public DFlash inference code).
    """
    if n < 1:
        raise ValueError(f"number of target features n = {n}: must be at least 1")
    if num_layers < 4 and n > 1:
        raise ValueError(f"num_layers = {num_layers}: the spread rule needs at least 4 layers")
    if n == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) != n:
        raise ValueError(
            f"n = {n} target features from {num_layers} layers repeat a layer ({ids}); "
            f"use at most {num_layers - 3}"
        )
    return ids


def states_per_token(layer_ids: list[int], last: bool = False) -> int:
    """Hidden states in a token's features: one per tapped layer, then the target's last hidden
    state where ``last`` (:func:`dflash.features.target_forward.target_features`)."""
    return len(layer_ids) + last


def feature_width(layer_ids: list[int], hidden: int, last: bool = False) -> int:
    """Features per token: :func:`states_per_token` states of ``hidden`` each."""
    return states_per_token(layer_ids, last) * hidden


def check_layer_selection(num_layers: int, n: int) -> None:
    """A params error, raised when the target stage first sees the target's depth, for a
    ``drafter.num_target_features`` that :func:`target_layer_ids` cannot spread over it:
    more than ``num_layers - 3`` layers (layers 1 .. L-3) would repeat one."""
    if n > 1 and n > num_layers - 3:
        raise ConfigError(
            f"drafter.num_target_features = {n}: a {num_layers}-layer target has "
            f"{max(num_layers - 3, 1)} distinct layers to fuse (layers 1 .. L-3), so {n} would "
            "repeat a layer"
        )


def target_depth(path: str | None, default_layers: int) -> int:
    """Decoder layers of ``target.path`` (its ``config.json``; no weights are read), or
    ``default_layers`` for the tiny default target."""
    if path is None:
        return default_layers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return config.get_text_config().num_hidden_layers
