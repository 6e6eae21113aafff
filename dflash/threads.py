"""How many CPU threads torch may use: one place, called at the start of each CPU-heavy stage."""

from __future__ import annotations

import os

import torch


def set_cpu_threads() -> int:
    """On CPU, use all cores this process may run on but one; returns the thread count.

    Measured on a shared 2-core machine: with every core busy elsewhere, 2 torch threads
    ran a training step 6x and a decoding step 10-60x slower than 1 thread, as OpenMP
    threads wait on each other; leaving a core free costs little when the machine is idle.
    """
    threads = max(1, len(os.sched_getaffinity(0)) - 1)
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    return threads
