"""Batch composition: how a step's loss follows the lengths of the samples it holds.

Length-sorted batches give each step samples of one length, so the loss swings with the
length of the batch rather than with training: the spikes of frozen length-sorted runs.
``loss_length_corr`` is the Spearman correlation of the finite steps' losses with their mean
sample lengths: near 0 when every step mixes lengths, large when steps are length-pure. Each
step also falls into one of the stats stage's length classes (``buckets.json``, the quantile
edges: classes of equal sample counts), whose mean loss is plotted per class.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CLASS_METHOD = "quantile"
"""The stats stage's boundary method whose edges name the length classes."""
MIN_STEPS = 3
"""Steps needed before a rank correlation means anything."""


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank (as Spearman's coefficient needs)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    out = np.empty(len(values), dtype=float)
    for start, end in zip(starts, ends, strict=True):
        out[order[start:end]] = (start + end + 1) / 2
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation; None with too few steps or a constant series."""
    if len(x) < MIN_STEPS or len(x) != len(y):
        return None
    rx, ry = ranks(np.asarray(x, dtype=float)), ranks(np.asarray(y, dtype=float))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def length_classes(buckets_json: Path | None) -> list[int]:
    """The upper edges of the stats stage's length classes; none without its file."""
    if buckets_json is None or not buckets_json.is_file():
        return []
    return [int(edge) for edge in json.loads(buckets_json.read_text())[CLASS_METHOD]["boundaries"]]


def class_name(edges: list[int], length: float) -> str | None:
    """``LO-HI`` of the class holding ``length`` (tokens), None without classes."""
    if not edges:
        return None
    i = min(int(np.searchsorted(edges, length, side="left")), len(edges) - 1)
    low = 1 if i == 0 else edges[i - 1] + 1
    return f"{low}-{edges[i]}"
