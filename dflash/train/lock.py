"""One training run per workspace: an exclusive lock on ``checkpoints/`` held while it runs.

Two runs on one workspace would resume from each other's checkpoints and race to publish
``models/drafter``. The lock is ``flock`` on a file holding the holder's PID: the kernel drops
it when the holder dies however it dies, so a lock left by a dead process is simply taken.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HELD_BY_LAUNCHER = "DFLASH_TRAIN_LOCK_HELD"
"""Set in the ranks' environment by a launcher that holds the lock for them."""


def launched_by_torchrun() -> bool:
    """Whether this process is a rank ``torchrun`` started (it sets both variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class WorkspaceBusy(RuntimeError):
    """Another live process holds the workspace's training lock."""


@contextmanager
def workspace_lock(path: str | Path) -> Iterator[int]:
    """Hold the lock at ``path`` for the block; its file descriptor, to hand to children."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise WorkspaceBusy(
                f"another training run (PID {holder}) holds {path}: this workspace has one "
                "writer at a time; wait for it or stop it, then rerun"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)
