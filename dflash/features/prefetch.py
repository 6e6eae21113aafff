"""A drafter rank's window of feature requests, posted ahead of the micro-batches in plan order.

A drafter rank whose features come from elsewhere (the target ranks of
:mod:`dflash.features.sources.decoupled`, the engines or files of
:class:`dflash.features.documents.DocumentFeatures`) asks for its next micro-batches' features
before it trains on them, at most ``train.feature_prefetch`` at a time, so they are computed
while it trains; the time it spends waiting on the oldest is the drafter's wait.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dflash.batching.io import Row

Request = TypeVar("Request")
Result = TypeVar("Result")


def epoch_micro_batches(
    steps: list[list[list[Row]]], first_step: int
) -> Iterator[tuple[int, list[Row]]]:
    """``(index within the epoch, rows)`` of a rank's micro-batches from ``first_step`` on."""
    index = sum(len(step) for step in steps[:first_step])
    for step in steps[first_step:]:
        for rows in step:
            yield index, rows
            index += 1


class Window(Generic[Request]):
    """Requests for at most ``depth`` micro-batches in flight, taken back in the order posted.

    ``post(index, rows)`` asks for one micro-batch's features; a request left over at the next
    epoch raises ``unused``, as the rank then trained on fewer micro-batches than it asked for.
    """

    def __init__(
        self, depth: int, post: Callable[[int, list[Row]], Request], unused: type[Exception]
    ) -> None:
        self.depth, self.post, self.unused = depth, post, unused
        self.pending: deque[tuple[int, list[Row], Request]] = deque()
        self.upcoming: Iterator[tuple[int, list[Row]]] = iter(())
        self.wait_s = 0.0
        self.taken = 0
        self.began = time.perf_counter()

    def restart_clock(self) -> None:
        self.began = time.perf_counter()

    def busy_s(self) -> float:
        """Seconds since the clock started not spent waiting on a request."""
        return time.perf_counter() - self.began - self.wait_s

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        if self.pending:
            raise self.unused(f"{len(self.pending)} micro-batches of features never used")
        self.upcoming = epoch_micro_batches(steps, first_step)
        self._fill()

    def _fill(self) -> None:
        while len(self.pending) < self.depth:
            index, rows = next(self.upcoming, (None, None))
            if index is None:
                return
            self.pending.append((index, rows, self.post(index, rows)))

    def take(self, wait: Callable[[int, Request], Result]) -> tuple[int, list[Row], Result]:
        """The oldest request, waited on (and timed) with ``wait(index, request)``; the next
        micro-batch is asked for before this one is handed back."""
        index, rows, request = self.pending.popleft()
        began = time.perf_counter()
        result = wait(index, request)
        self.wait_s += time.perf_counter() - began
        self.taken += 1
        self._fill()
        return index, rows, result
