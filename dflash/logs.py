"""Log lines that name their stage and, in a torchrun job, their rank: ``[train rank 1] ...``.

Library modules log to ``logging.getLogger(__name__)``; :func:`setup`, which
:func:`dflash.cli.run_stage` calls for every stage and every rank, prints those records where
the ``print`` calls they replace went: progress on stdout, warnings and errors on stderr. The
ranks of a job share one terminal, so each line says whose it is. ``DFLASH_LOG_LEVEL`` sets how
much is shown. While tqdm is loaded a line goes through ``tqdm.write``, which lifts a bar off
the terminal and redraws it below the line.

torch is not imported here (the command line answers before it loads): the rank comes from
``torch.distributed`` once something else loaded and initialised it, else from ``RANK``.
"""

from __future__ import annotations

import logging
import os
import sys

from dflash.errors import ConfigError

LEVEL_VAR = "DFLASH_LOG_LEVEL"
"""The environment variable naming the lowest level shown: DEBUG, INFO (the default), WARNING
or ERROR."""


def setup(stage: str) -> None:
    """Print the ``dflash`` loggers' records as ``[stage] ...`` lines. A later call (the next
    stage run in the same process) replaces the earlier call's handler."""
    name = os.environ.get(LEVEL_VAR, "INFO").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ConfigError(f"{LEVEL_VAR} = {name!r}: not a level (DEBUG, INFO, WARNING, ERROR)")
    logger = logging.getLogger("dflash")
    for handler in [h for h in logger.handlers if isinstance(h, TerminalHandler)]:
        logger.removeHandler(handler)
    handler = TerminalHandler()
    handler.setFormatter(StageFormatter(stage))
    logger.addHandler(handler)
    logger.setLevel(level)


def rank() -> int | None:
    """This process's rank in a torchrun job, or None outside one."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK")
    return None if value is None else int(value)


class StageFormatter(logging.Formatter):
    """``[stage rank N] message``, the rank only in a torchrun job; a warning or an error
    says which it is."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def format(self, record: logging.LogRecord) -> str:
        r = rank()
        where = self.stage if r is None else f"{self.stage} rank {r}"
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"[{where}] {level}{super().format(record)}"


class TerminalHandler(logging.Handler):
    """stdout below WARNING, stderr from it up. The stream is looked up at each record, so a
    redirected ``sys.stdout`` (pytest's capture, ``contextlib.redirect_stdout``) gets it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            bars = sys.modules.get("tqdm")  # no bar can be on the terminal before tqdm loads
            if bars is None:
                stream.write(text + "\n")
            else:
                bars.tqdm.write(text, file=stream)
            stream.flush()
        except Exception:
            self.handleError(record)
