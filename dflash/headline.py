"""The few figures per stage that ``dvc exp show`` compares; every other figure is a detail.

Each stage that measures something writes two files: its details (every figure, a plain DVC
output that ``dflash report`` and ``publish`` read) and its headline (the keys below, declared
under ``metrics:`` in ``dvc.yaml``). DVC shows every number and string leaf of every metrics
file, so only the headline keeps ``dvc exp show`` to one screen: which batching strategy
trains how fast, and to what loss and τ. DVC skips lists, so a list here costs no column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.fileio import write_json_atomic

TARGET = ("heldout_perplexity",)
REGENERATE = ("conversations", "turns_regenerated", "tokens_generated", "unterminated_responses")
TRAIN = (
    "tokens_per_s",
    "padded_tokens_per_s",
    "padding_efficiency",
    "steps",
    "final_loss",
    "loss_spikes",
    "grad_norm_cv",
)
EVAL = (
    "acceptance_length",
    "acceptance_length_ci95",
    "acceptance_length_pooled",
    "acceptance_length_zlab",
    "per_position_acceptance",
    "baselines.ngram.acceptance_length",
    "baselines.untrained.acceptance_length",
    "lossless_mismatches",
    "n_prompts",
    "heldout_loss_by_length.short",
    "heldout_loss_by_length.medium",
    "heldout_loss_by_length.long",
)
"""The contract keys of ``metrics/eval.json`` and the per-length losses that
``bench/sweep_table.py`` tabulates; :func:`dflash.eval.outputs.eval_headline` adds the interval's
two ends, ``acceptance_length_ci95_low`` and ``_high``, as numbers DVC shows."""


def headline(data: dict, keys: tuple[str, ...]) -> dict:
    """The dotted ``keys`` of ``data`` that it has, nested as in ``data``."""
    out: dict[str, Any] = {}
    for key in keys:
        *parents, leaf = key.split(".")
        source, target = data, out
        for part in parents:
            source = source.get(part) if isinstance(source, dict) else None
            target = target.setdefault(part, {})
        if isinstance(source, dict) and leaf in source:
            target[leaf] = source[leaf]
    return prune(out)


def prune(tree: dict) -> dict:
    """``tree`` without the empty dicts a missing nested key left behind."""
    kept = {k: prune(v) if isinstance(v, dict) else v for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v != {}}


def write_metrics(path: Path, details: Path, data: dict, keys: tuple[str, ...]) -> None:
    """``data`` whole to ``details``, then its headline to ``path``: the headline comes last,
    so its presence says the stage finished."""
    write_json_atomic(details, data, sort_keys=True)
    write_json_atomic(path, headline(data, keys), sort_keys=True)
