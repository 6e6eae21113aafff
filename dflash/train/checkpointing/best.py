"""The best validation's drafter weights (``train.keep_best``), kept beside the checkpoints.

Each file is named by its step, so the ``best_step`` a checkpoint records always names the
weights it meant: a run killed after keeping a newer best resumes with the older step, and
that step's file is still there. Files are pruned only once a checkpoint has recorded a newer
best (:func:`prune`), and a run that starts fresh starts with none.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from dflash.fileio import atomic_path

DIRECTORY = "best"
"""Under the run's checkpoint directory."""
NAME = "step_{step:08d}.safetensors"
"""One kept drafter's whole weights, with its step in the file's metadata too."""


def best_path(run_dir: Path, step: int) -> Path:
    return run_dir / DIRECTORY / NAME.format(step=step)


def keep(run_dir: Path, step: int, weights: dict[str, Tensor]) -> None:
    """Write the whole drafter ``weights`` of ``step``, complete or not at all."""
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()}
    with atomic_path(best_path(run_dir, step)) as tmp:
        save_file(state, tmp, metadata={"step": str(step)})


def load(run_dir: Path, step: int) -> dict[str, Tensor]:
    path = best_path(run_dir, step)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the best validation's weights (train.keep_best) are missing; remove "
            f"{run_dir} to train again from the start"
        )
    return load_file(path)


def prune(run_dir: Path, step: int) -> None:
    """Remove every kept file but ``step``'s (the best a checkpoint has just recorded)."""
    directory, mine = run_dir / DIRECTORY, best_path(run_dir, step)
    for path in directory.glob("step_*") if directory.is_dir() else ():
        if path != mine:
            path.unlink(missing_ok=True)


def clear(run_dir: Path) -> None:
    """No kept weights: for a run that starts fresh."""
    shutil.rmtree(run_dir / DIRECTORY, ignore_errors=True)
