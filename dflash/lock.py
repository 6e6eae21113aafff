"""One writer per workspace: an exclusive lock held while a stage that writes it runs.

Two runs on one workspace would resume from each other's checkpoints and race to publish
``models/drafter``, and a ``dflash plan`` run while ``train`` reads the plans would leave a
drafter beside plans and metrics of another strategy. Every pipeline stage therefore holds
the workspace's lock while it runs (``dflash.cli``; the train launcher for its ranks), and so
does ``dflash clean``. The lock is ``flock`` on a file holding the holder's PID and command:
the kernel drops it when the holder dies however it dies, so a lock left by a dead process is
simply taken. It is taken before any heavy import, so a busy workspace is refused at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash.errors import UserError

HELD_BY_LAUNCHER = "DFLASH_TRAIN_LOCK_HELD"
"""Set in the ranks' environment by a launcher that holds the lock for them."""


def launched_by_torchrun() -> bool:
    """Whether this process is a rank ``torchrun`` started (it sets both variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class WorkspaceBusy(UserError, RuntimeError):
    """Another live process holds the workspace's lock (exit 2)."""


@contextmanager
def workspace_lock(path: str | Path, holder: str) -> Iterator[int]:
    """Hold the lock at ``path`` for the block, as ``dflash <holder>``; its file descriptor,
    to hand to children."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, command = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
            who = f"`dflash {command}`" if command else "another dflash command"
            raise WorkspaceBusy(
                f"{who} (PID {pid or 'unknown'}) holds {path}: a workspace has one writer at a "
                "time; wait for it or stop it, then rerun"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {holder}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)
