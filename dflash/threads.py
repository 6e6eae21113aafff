"""How many CPU threads torch may use: one place, called at the start of each CPU-heavy stage."""

from __future__ import annotations

import os

import torch


def set_cpu_threads() -> int:
    """On CPU, use every core this process may run on, unless ``OMP_NUM_THREADS`` says else.

    DVC runs stages one at a time, so a single-process stage has the machine to itself: on
    the 2-core reference machine, 2 threads ran the tiny target's pretraining step 1.9x and
    its prefill 2.0x faster than 1. On a machine busy with other work, OpenMP threads wait on
    each other (2 threads were 6x slower than 1 there); ``OMP_NUM_THREADS=1`` is the remedy,
    and ``torchrun`` sets it for each rank of a multi-process run.
    """
    threads = len(os.sched_getaffinity(0))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    return threads
