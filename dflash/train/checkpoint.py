"""Atomic, verified training checkpoints, and saving and resuming a run with them.

A checkpoint is written to a temporary file, fsynced and renamed, and its SHA-256 is written
beside it last; one without a matching digest (killed mid-write, truncated, bit-rotted) is
skipped on resume and the one before it is used. A ``run_fingerprint`` of everything the
weights depend on (params, token contents, plans, target, tokenizer, code) keeps a rerun
from resuming a checkpoint that belongs to another run. Checkpoints hold state dicts and
plain types only, so they load with ``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash import paths
from dflash.closure import code_digest
from dflash.config import Config
from dflash.declaration import declared_params, restrict, stages
from dflash.fileio import atomic_path, remove_files, sha256_file, write_text_atomic
from dflash.fingerprint import digest, path_digest
from dflash.model.load import target_digest
from dflash.train.distributed import barrier

if TYPE_CHECKING:
    from dflash.train.loop import Trainer


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / paths.CHECKPOINT_NAME.format(step=step)


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
    return int(path.stem.rpartition("_")[2])


def remove_checkpoint(path: Path) -> None:
    path.unlink(missing_ok=True)
    _digest_path(path).unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, newest (highest step) first."""
    if not directory.exists():
        return []
    return sorted(directory.glob(paths.CHECKPOINT_GLOB), reverse=True)


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
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is skipped, and said so
            skipped.append(f"{path.name}: unreadable ({type(err).__name__}: {err})")
            continue
        if state.get("fingerprint") != fingerprint:
            skipped.append(f"{path.name}: belongs to another run (params, plan or data differ)")
            continue
        return state, skipped
    return None, skipped


def remove_checkpoints(directory: Path) -> None:
    for path in directory.glob(paths.CHECKPOINT_GLOB + "*"):
        path.unlink(missing_ok=True)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_fingerprint(config: Config) -> str:
    """Everything the trained weights depend on; a checkpoint resumes only into the same run.

    Contents, not counts: a tokenizer fix that keeps every length changes the token store's
    bytes and so the fingerprint. The params are the ones ``train`` declares (its knobs
    change no weight); the code is the train stage's import closure (``dflash.closure``).
    """
    declared = stages()["train"]
    params = declared_params(restrict(config, declared.params))
    return digest(
        {
            "params": params,
            "tokens": path_digest(paths.TOKENIZED),
            "plans": path_digest(paths.PLANS),
            "target": target_digest(paths.TARGET),
            "tokenizer": path_digest(paths.TOKENIZER),
            "code": code_digest(declared.module),
        }
    )


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


def save(trainer: Trainer) -> None:
    """Checkpoint the run at its current step (all ranks call it; rank 0 writes)."""
    ctx = trainer.ctx
    gathered: list[Any] = [rng_state()]
    if ctx.enabled:
        gathered = [None] * ctx.world_size
        torch.distributed.all_gather_object(gathered, rng_state())
    if ctx.is_main:
        save_checkpoint(
            paths.CHECKPOINTS,
            trainer.state["global_step"],
            {
                "fingerprint": trainer.fingerprint,
                "drafter": trainer.drafter.state_dict(),
                "optimizer": trainer.optimizer.state_dict(),
                "scheduler": trainer.scheduler.state_dict(),
                "state": trainer.state,
                "rng": gathered,
            },
            keep=trainer.config.train.keep_checkpoints,
        )
    barrier(ctx)


def resume(trainer: Trainer) -> None:
    """Load the newest intact checkpoint of this run into ``trainer``, or start fresh."""
    ctx = trainer.ctx
    if ctx.is_main:
        # A run under way has no final metrics: a kill before it ends must not leave the
        # previous run's beside a new drafter (the metrics are written last, after export).
        remove_files(paths.TRAIN_METRICS)
    saved, skipped = load_latest(paths.CHECKPOINTS, trainer.fingerprint)
    if ctx.is_main:
        for reason in skipped:
            print(f"[train] skipping checkpoint {reason}")
    barrier(ctx)
    if saved is None:
        if ctx.is_main and list_checkpoints(paths.CHECKPOINTS):
            print("[train] no checkpoint of this run: starting fresh, old ones removed")
            remove_checkpoints(paths.CHECKPOINTS)
        barrier(ctx)
        return
    if ctx.is_main:
        # Newer files passed over (unfinished, corrupt, another run's) would otherwise be
        # counted as "newest" when pruning and crowd out the checkpoints this run writes.
        for path in list_checkpoints(paths.CHECKPOINTS):
            if step_of(path) > saved["state"]["global_step"]:
                remove_checkpoint(path)
    trainer.drafter.load_state_dict(saved["drafter"])
    trainer.optimizer.load_state_dict(saved["optimizer"])
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.state = saved["state"]
    if ctx.rank < len(saved["rng"]) and saved["rng"][ctx.rank] is not None:
        set_rng_state(saved["rng"][ctx.rank])
    if ctx.is_main:
        s = trainer.state
        print(
            f"[train] resumed at epoch {s['epoch']} step {s['step_in_epoch']} "
            f"(global step {s['global_step']})"
        )
