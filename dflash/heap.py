"""Python's cyclic garbage collector in a dflash process: paused while the stack imports, and
skipped as the interpreter tears down.

Importing torch and transformers leaves about 400,000 long-lived objects. The collector scans
them over and over while they are made, and once more at exit, and finds nothing to free:
about 1 CPU-second per process while importing and 1 more at exit, paid by every rank,
launcher, loader worker and stage process (``bench/process_start.py`` measures both). What a
run makes afterwards is collected as usual; only the import-time heap is set aside.
"""

from __future__ import annotations

import atexit
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def skip_exit_collection() -> None:
    """Freeze the heap at exit: the interpreter's teardown then skips its full collection of
    objects the OS frees anyway. For entry points; calling it again registers nothing more."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


@contextmanager
def imports_settled() -> Iterator[None]:
    """Run the block with automatic collection paused; if it imported modules new to this
    process, collect once and freeze what survives, so later collections skip it. In a
    process that had the modules already (a test calling a stage in process), only the pause."""
    enabled, known = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > known:
            gc.collect()  # what the imports left as garbage is freed, not frozen for good
            gc.freeze()
        if enabled:
            gc.enable()
