"""Throughput leaves out each process's warm-up steps and times steps on the device."""

from __future__ import annotations

import pytest
import torch

from dflash.train.checkpointing.state import TrainState
from dflash.train.observe import clock
from dflash.train.observe.clock import WARMUP_STEPS, StepClock
from dflash.train.observe.summary import throughput


def test_warm_up_steps_are_timed_but_not_counted_as_throughput():
    steps = StepClock(torch.device("cpu"))
    counted = []
    for _ in range(WARMUP_STEPS + 2):
        seconds, timed = steps.stop(steps.start())
        assert seconds >= 0
        counted.append(timed)
    assert counted == [False] * WARMUP_STEPS + [True, True]


def test_throughput_is_over_the_steps_past_warm_up():
    state = TrainState(elapsed_s=10.0, real_tokens=1000, padded_tokens=2000)
    assert throughput(state) == {"tokens_per_s": 100.0, "padded_tokens_per_s": 200.0}
    state.timed_s, state.timed_real_tokens, state.timed_padded_tokens = 2.0, 600, 800
    assert throughput(state) == {"tokens_per_s": 300.0, "padded_tokens_per_s": 400.0}


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: each record is one device millisecond later."""

    now = 0.0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = None
        self.synchronized = False

    def record(self) -> None:
        FakeEvent.now += 1.0
        self.at = FakeEvent.now

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.synchronized, "read before the device reached the end mark"
        return end.at - self.at


def test_on_cuda_steps_are_timed_with_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(clock.time, "perf_counter", lambda: pytest.fail("host clock on CUDA"))
    steps = StepClock(torch.device("cuda", 0))
    seconds, timed = steps.stop(steps.start())
    assert seconds == pytest.approx(0.001) and not timed
