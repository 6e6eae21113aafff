"""Atomic, verified training checkpoints.

A checkpoint is written to a temporary file, fsynced and renamed, and its SHA-256 is written
beside it last; one without a matching digest (killed mid-write, truncated, bit-rotted) is
skipped on resume and the one before it is used. A ``fingerprint`` of everything the run
depends on (params, plan, token store) keeps a rerun with other params from resuming a
checkpoint that belongs to another experiment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dflash.fileio import atomic_path, sha256_file, write_text_atomic

PATTERN = "step_*.pt"


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    write_text_atomic(_digest_path(path), sha256_file(path), fsync=True)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[keep:]:
        remove_checkpoint(old)
    return path


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".pt"))


def remove_checkpoint(path: Path) -> None:
    path.unlink(missing_ok=True)
    _digest_path(path).unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest (highest step) first."""
    if not directory.exists():
        return []
    return sorted(directory.glob(PATTERN), reverse=True)


def load_latest(directory: Path, fingerprint: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest intact checkpoint of this run, and why each newer one was passed over."""
    skipped: list[str] = []
    for path in list_checkpoints(directory):
        digest = _digest_path(path)
        if not digest.exists():
            skipped.append(f"{path.name}: no digest (write did not finish)")
            continue
        if digest.read_text().strip() != sha256_file(path):
            skipped.append(f"{path.name}: digest mismatch (truncated or corrupt)")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any unreadable file is skipped, and said so
            skipped.append(f"{path.name}: unreadable ({type(err).__name__}: {err})")
            continue
        if state.get("fingerprint") != fingerprint:
            skipped.append(f"{path.name}: belongs to another run (params, plan or data differ)")
            continue
        return state, skipped
    return None, skipped


def remove_checkpoints(directory: Path) -> None:
    for path in directory.glob("step_*"):
        path.unlink(missing_ok=True)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
