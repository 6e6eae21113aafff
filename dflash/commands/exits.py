"""How a command ends: its exit status, and one line on stderr that says why.

A user's mistake (bad input, a refused run) exits 2 and the machine's (disk full, no
permission, a run that cannot go on) 1; Ctrl-C and SIGTERM exit as the shell expects, saying
that a rerun resumes. A torchrun rank that fails ends at once (:func:`exit_rank`), its
unexpected error's traceback in the job's failure log.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from dflash.errors import OutputError, RunStopped, UserError
from dflash.fileio import SIGINT_EXIT, SIGTERM_EXIT, exit_on_sigterm
from dflash.pipeline.lock import FAILURE_LOG, launched_by_torchrun, record_exit


def ended(stage: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status; a failure it raises as its status and one line. An unexpected
    error propagates with its traceback, except on a torchrun rank (:func:`report_crash`)."""
    try:
        with exit_on_sigterm():
            return run()
    except KeyboardInterrupt:
        print(f"dflash {stage}: interrupted; rerun to resume", file=sys.stderr)
        return SIGINT_EXIT
    except SystemExit as stopped:
        if stopped.code != SIGTERM_EXIT:
            raise
        print(f"dflash {stage}: terminated (SIGTERM); rerun to resume", file=sys.stderr)
        return SIGTERM_EXIT
    except (UserError, FileNotFoundError, OutputError, RunStopped) as err:
        code = report(stage, err)
        if launched_by_torchrun():
            exit_rank(code)  # here, while ``err`` still holds what it would free
        return code
    except Exception as err:
        if launched_by_torchrun():
            report_crash(stage, err)
            exit_rank(1)
        raise


def report(stage: str, err: Exception) -> int:
    """Print ``err`` in one line; its exit status: 2 for the user's input, 1 for the machine
    (disk full, no permission, read-only)."""
    missing = isinstance(err, FileNotFoundError) and err.filename
    print(f"dflash {stage}: {f'no such file: {missing}' if missing else err}", file=sys.stderr)
    return 1 if isinstance(err, OutputError | RunStopped) else 2


def report_crash(stage: str, err: Exception) -> None:
    """A rank's unexpected error: its traceback in the job's failure log, where the launcher
    set one (:mod:`dflash.train.distributed.agent`), and one line naming the rank, the error
    and the log; else the traceback."""
    log, rank = os.environ.get(FAILURE_LOG), os.environ.get("RANK", "0")
    try:
        with open(log or "", "a") as f:
            f.write(f"rank {rank}: {''.join(traceback.format_exception(err))}")
    except OSError:  # no log (torchrun run by hand), or none to write
        traceback.print_exception(err)
        return
    message = next(iter(str(err).strip().splitlines()), "")
    print(
        f"dflash {stage}: rank {rank}: {type(err).__name__}: {message} (traceback: {log})",
        file=sys.stderr,
    )


def exit_rank(code: int) -> NoReturn:
    """End a failed torchrun rank without the interpreter's teardown. Freeing a gloo process
    group (held by DDP in the failed frames) joins its worker thread with the GIL held, while
    that thread may wait for the GIL to free the last collective's tensors (torch 2.13): the
    rank would hang, and torchrun would hold every node's job open waiting for it. Outputs are
    written whole or not at all, so nothing is left to flush but the streams."""
    record_exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
