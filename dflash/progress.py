"""Progress bars that suit both a terminal and a log file.

On a terminal a tqdm bar redraws in place. Under ``dvc repro`` or a job scheduler stdout is
a file, and every carriage-return frame of a bar lands in the log: tens of kilobytes for a
short run, growing with the data. There the bar prints a plain line at most every
:data:`LOG_INTERVAL_S` seconds instead, enough to see that a long stage is alive.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0
"""Seconds between progress lines when stdout is not a terminal."""


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A ``tqdm`` bar on a terminal, a line every :data:`LOG_INTERVAL_S` seconds otherwise."""
    if not sys.stdout.isatty():
        kwargs = {
            **kwargs,
            "mininterval": LOG_INTERVAL_S,
            "maxinterval": LOG_INTERVAL_S,
            "ascii": True,
            "dynamic_ncols": False,
            "ncols": 80,
            "file": _LineWriter(sys.stderr),
        }
        return _LogBar(iterable, **kwargs)
    return tqdm(iterable, **kwargs)


class _LogBar(tqdm):
    """A bar whose postfix waits for the next timed line: tqdm's ``set_postfix`` redraws at
    once by default, which would print a line every step however long the interval."""

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


class _LineWriter:
    """Turn tqdm's ``\\r``-led frames into newline-ended lines, so a log gets one per update."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()
