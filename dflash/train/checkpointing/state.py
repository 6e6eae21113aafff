"""The run's own progress as one typed, checkpointable part: counters, RNG, history.

``TrainState`` is a ``Stateful`` part among the drafter, optimizer and scheduler parts that
:mod:`dflash.train.checkpointing.checkpoint` saves, so the loop keeps typed fields instead of a
dict of
string keys. Each rank saves its own copy under its own key: the RNG streams and the wall
clock differ per rank, and the log rows exist on rank 0 only, so one shared key would keep
whichever rank's copy the checkpoint planner happened to pick.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch generator states as tensors and plain types."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(words), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    version, words, gauss = rng["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


LOGS = ("epoch_loss", "rows", "history")
"""The fields that grow with the run (see ``TrainState.state_dict``)."""


@dataclass
class TrainState:
    """Where the run is (epoch, step in it, global step) and what it has counted so far."""

    epoch: int = 0
    step_in_epoch: int = 0
    """Position in the epoch's plan: the next step this rank runs."""
    global_step: int = 0
    nonfinite_in_a_row: int = 0
    skipped_steps: int = 0
    elapsed_s: float = 0.0
    data_wait_s: float = 0.0
    real_tokens: int = 0
    padded_tokens: int = 0
    timed_s: float = 0.0
    """Seconds of the steps past each process's warm-up (``dflash.train.observe.clock``)."""
    timed_real_tokens: int = 0
    timed_padded_tokens: int = 0
    best_step: int = -1
    """``train.keep_best``: the global step of the best validation so far (-1: none yet)."""
    best_val_simulated_tau: float = -math.inf
    """Its ``val_simulated_tau``; a later validation must beat it to replace the kept weights."""
    epoch_loss: list[tuple[int, float, float]] = field(default_factory=list)
    """``(epoch, loss, weight)`` of every finite step, for the final loss."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The logged rows (rank 0), which the monitor appends to."""
    history: dict[str, Any] = field(default_factory=dict)
    """The monitor's running statistics (rank 0)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's fields and RNG streams under its own key (see the module docstring).

        The growing lists go in as one JSON string: a checkpoint loads into a state dict of
        the same shape as the one it saved, which a list longer at save than at load is not.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        log = {name: fields.pop(name) for name in LOGS}
        return {f"rank_{_rank()}": {**fields, "log": json.dumps(log), "rng": rng_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = dict(state[f"rank_{_rank()}"])
        set_rng_state(mine.pop("rng"))
        mine |= json.loads(mine.pop("log"))
        mine["epoch_loss"] = [tuple(entry) for entry in mine["epoch_loss"]]
        for name, value in mine.items():
            setattr(self, name, value)
