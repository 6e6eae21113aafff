"""Training ranks die with their launcher instead of training on as orphans.

``torchrun`` starts each rank in a session of its own, so killing the launcher's process group
(a crashed shell, ``kill -9``) used to leave the ranks training and writing checkpoints and
``models/drafter`` beside any rerun. Linux's parent-death signal ends them with their parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""From ``<linux/prctl.h>``."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    A parent that died before the request was made is caught by the check that follows: the
    process has then been handed to an init process already.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() == 1:
        os.kill(os.getpid(), sig)


def parent_death_signal(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess``: the child gets ``sig`` when this process dies."""
    return lambda: die_with_parent(sig)
