"""Errors shared by every floor of the package (it imports nothing of ours).

The command line turns a ``UserError`` into its message and exit status 2, with no traceback:
a bad param, an input file that is missing or malformed, a stage to run first. An
``OutputError`` is the machine's fault (disk full, no permission) and a ``RunStopped`` a run
that cannot go on: one line and exit 1.
"""

import errno
from pathlib import Path


class UserError(Exception):
    """Base class: the message says what to change; the command exits 2."""


class ConfigError(UserError, ValueError):
    """A parameter is unknown or has a value outside what is allowed."""


class BatchingError(UserError, ValueError):
    """The lengths or params cannot give a valid plan (subclasses in ``dflash.batching.errors``)."""


class DirectoryInUse(UserError, FileExistsError):
    """An output directory a user named holds what the writer must not replace; it is left as
    it was. A ``FileExistsError`` too, for callers that catch the ``OSError`` family."""


class UndeclaredParamError(RuntimeError):
    """A stage read a param that ``dvc.yaml`` does not declare for it: a bug in the code or the
    declaration, never the user's, so it is no ``UserError`` and keeps its traceback."""


class RunStopped(RuntimeError):
    """A run that cannot go on, for a reason its message names (too many non-finite losses):
    one line and exit 1, as for the machine's faults; its outputs are left as they were."""


class OutputError(RuntimeError):
    """An output could not be published for a fault of the machine; the old one is intact."""

    def __init__(self, path: str | Path, err: OSError) -> None:
        name = errno.errorcode.get(err.errno, str(err.errno))
        super().__init__(
            f"cannot write {path}: {name} ({err.strerror or err}); the previous output, "
            "if any, is left as it was"
        )
        self.errno = err.errno
