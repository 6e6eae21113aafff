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
from dflash.metrics.schema import (
    NULL_REASONS,
    EvalHeadline,
    Metrics,
    RegenerateHeadline,
    TargetHeadline,
    TrainHeadline,
    leaves,
)

CI_ENDS = ("acceptance_length_ci95_low", "acceptance_length_ci95_high")
"""τ's interval as two numbers DVC shows, which :func:`dflash.eval.outputs.eval_headline` adds."""
TARGET = leaves(TargetHeadline)
REGENERATE = leaves(RegenerateHeadline)
TRAIN = leaves(TrainHeadline)
EVAL = tuple(key for key in leaves(EvalHeadline) if key not in CI_ENDS)
"""The contract keys of ``metrics/eval.json`` and the per-length losses that
``bench/sweep_table.py`` tabulates. Each tuple holds the dotted keys of its file's model
(:mod:`dflash.metrics.schema`)."""


def headline(data: dict, keys: tuple[str, ...]) -> dict:
    """The dotted ``keys`` of ``data`` that it has, nested as in ``data``; the reasons for
    null figures (:data:`NULL_REASONS`) only of the figures kept."""
    out: dict[str, Any] = {}
    for key in keys:
        *parents, leaf = key.split(".")
        source, target = data, out
        for part in parents:
            source = source.get(part) if isinstance(source, dict) else None
            target = target.setdefault(part, {})
        if isinstance(source, dict) and leaf in source:
            target[leaf] = source[leaf]
    reasons = {k: v for k, v in (out.pop(NULL_REASONS, None) or {}).items() if k in out}
    return prune(out | ({NULL_REASONS: reasons} if reasons else {}))


def prune(tree: dict) -> dict:
    """``tree`` without the empty dicts a missing nested key left behind."""
    kept = {k: prune(v) if isinstance(v, dict) else v for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v != {}}


def write_metrics(path: Path, details: Path, data: Metrics, model: type[Metrics]) -> None:
    """``data`` whole to ``details``, then its headline, as ``model``, to ``path``: the
    headline comes last, so its presence says the stage finished."""
    whole = data.dump()
    write_json_atomic(details, whole, sort_keys=True)
    shown = model.model_validate(headline(whole, leaves(model)))
    write_json_atomic(path, shown.dump(), sort_keys=True)
