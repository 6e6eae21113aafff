"""One writer per workspace: an exclusive lock held while a stage that writes it runs.

Two runs on one workspace would resume from each other's checkpoints and race to publish
``models/drafter``, and a ``dflash plan`` run while ``train`` reads the plans would leave a
drafter beside plans and metrics of another strategy. Every pipeline stage therefore holds
the workspace's lock while it runs (``dflash.cli``; the train launcher for its ranks), and so
does ``dflash clean``. The lock is ``flock`` on a file holding the holder's PID and command:
the kernel drops it when the holder dies however it dies, so a lock left by a dead process is
simply taken. It is taken before any heavy import, so a busy workspace is refused at once.
The train launcher and its torchrun ranks also agree here on what the ranks' environment says.
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


EXIT_DIR = "DFLASH_RANK_EXITS"
"""Where a failed rank leaves its exit status for the launcher: torchrun exits 1 whatever its
ranks did, and a rank that refused the user's input (2) should make the job exit 2 too."""


FAILURE_LOG = "DFLASH_TRAIN_FAILURES"
"""The file a failed job's full report goes to, set by the launcher for ``torchrun``'s agent
(:mod:`dflash.train.distributed.agent`) and its ranks: the terminal gets one line naming it."""


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


def record_exit(code: int) -> None:
    """Leave this rank's exit status where its launcher reads it (no-op outside one)."""
    where = os.environ.get(EXIT_DIR)
    if where:
        (Path(where) / f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))


def refused(where: Path) -> bool:
    """Whether a rank launched with ``EXIT_DIR=where`` exited 2: it refused the input."""
    return any(f.read_text() == "2" for f in where.glob("rank-*"))
