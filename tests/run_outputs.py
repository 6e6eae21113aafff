"""What a training run leaves in its workspace, read one way by every test: the logged
losses, the exported drafter's weights, and the check that two runs trained the same drafter."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def logged(workspace: Path, column: str) -> list[float]:
    """``column`` of each row of ``plots/train/log.csv`` that has a value in it."""
    with open(workspace / "plots/train/log.csv") as f:
        return [float(row[column]) for row in csv.DictReader(f) if row[column] != ""]


def losses(workspace: Path) -> list[float]:
    """Each logged step's loss (every row has one)."""
    with open(workspace / "plots/train/log.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def final_weights(workspace: Path) -> dict[str, torch.Tensor]:
    return load_file(workspace / "models/drafter/model.safetensors")


def assert_same_drafter(reference: Path, workspace: Path) -> None:
    """``workspace``'s run logged ``reference``'s losses and exported its weights (fp32
    round-off apart: the runs computed the same steps on other ranks)."""
    assert losses(workspace) == pytest.approx(losses(reference), abs=1e-6, rel=0)
    a, b = final_weights(reference), final_weights(workspace)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0)
