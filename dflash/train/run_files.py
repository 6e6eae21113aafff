"""What a training run reads and writes, and what it records of its declaration.

The train stage builds both from its workspace and its declaration (``dflash.stages.train``)
and hands them down, so the loop reads no working directory and no ``dvc.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.pipeline.fingerprint import path_digest


@dataclass(frozen=True)
class TrainFiles:
    tokenized: Path
    """The token store (:mod:`dflash.data.store`)."""
    plans: Path
    target: Path
    tokenizer: Path
    heldout: Path
    """Held-out conversations: the batch simulated τ is measured on (may be missing)."""
    checkpoints: Path
    drafter: Path
    """Where the trained drafter is exported, replaced whole."""
    metrics: Path
    details: Path
    log: Path
    """The training curves as CSV, rewritten at every log row."""
    live: Path
    """DVCLive's directory."""
    init: Path | None = None
    """The checkpoint training starts from (``drafter.init_from``); None from scratch."""
    steps: Path | None = None
    """Every finite step's loss and mean sample length, as CSV, written at the end."""
    buckets: Path | None = None
    """The stats stage's ``buckets.json``: the length classes the loss is plotted by."""
    features: Path | None = None
    """The capture stage's features, read with ``train.features: files``."""
    hidden_states: Path | None = None
    """Where engines write the states ``train.topology: engine`` reads (and deletes)."""


@dataclass(frozen=True)
class Declared:
    params: dict[str, Any]
    """Every param the run reads, by section: logged, and recorded in the model card."""
    inputs: dict[str, Any]
    """What the weights depend on by declaration (params and code), for the checkpoint
    fingerprint."""


def weight_inputs(files: TrainFiles, declared: Declared) -> dict[str, Any]:
    """What the weights depend on by declaration, and the starting checkpoint's contents: a
    run from another checkpoint never resumes this one's training checkpoints."""
    if files.init is None:
        return declared.inputs
    return declared.inputs | {"init": path_digest(files.init)}
