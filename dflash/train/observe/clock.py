"""Step times for throughput: CUDA events on a GPU, the wall clock on CPU, warm-up left out."""

from __future__ import annotations

import time

import torch

WARMUP_STEPS = 3
"""Optimizer steps of each process that throughput leaves out: the first ones compile kernels,
fill the allocator's cache and start the data workers, so they time set-up, not training. A
resumed process warms up again."""


class StepClock:
    """Times each step on the device's own timeline.

    On CUDA the host returns before the device has finished, so host time would count queued
    work in whichever step happens to wait for it; events recorded on the stream time what the
    device did between two marks, idle gaps included.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps = 0

    def start(self) -> torch.cuda.Event | float:
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            return mark
        return time.perf_counter()

    def stop(self, start: torch.cuda.Event | float) -> tuple[float, bool]:
        """Seconds since ``start``, and whether the step is past warm-up (counts as throughput)."""
        self.steps += 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = time.perf_counter() - start
        return seconds, self.steps > WARMUP_STEPS
