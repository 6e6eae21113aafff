"""Durable file writes: a reader sees the old file or the new one, never half of one.

Every stage output is written to a temporary file in the same directory and renamed over
the target (``os.replace`` is atomic within a filesystem), so a run killed mid-write leaves
no truncated JSON or Parquet for DVC, a resumed run or a trainer to trust.

A fault of the machine while publishing (disk full, permission denied, read-only file system)
becomes an :class:`OutputError`: one line naming the output and the errno, the old output left
as it was. An output directory that is a symbolic link is followed: the directory it points to
is swapped whole beside itself and the link stays. A directory is swapped in two renames (the
old one to ``.old``, the new one in its place); a process killed between them leaves the old
one at ``.old``, put back by the next write (:func:`recover_dir`). A link where a file output
goes is replaced by the new file, never written through (it may point into DVC's read-only
cache).

Every output gets the mode the process's umask gives a plain ``open`` (``0644`` under ``022``),
whatever the writer chose: ``safetensors`` creates its files ``0600``, which would leave weights
no other user can read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash.errors import DirectoryInUse, OutputError

FAULTS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS}
)
"""Errnos a user fixes on the machine (free space, permissions, mounts), not in the code."""


@contextmanager
def machine_faults(path: str | Path) -> Iterator[None]:
    """Turn an ``OSError`` of :data:`FAULTS` raised while writing ``path`` into an OutputError."""
    try:
        yield
    except OSError as err:
        if err.errno not in FAULTS:
            raise
        raise OutputError(path, err) from err


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` on success.

    Parents are created; on an exception the temporary file is removed and ``path`` is left
    as it was. For writers that want a file name (``pyarrow.parquet.write_table``).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with machine_faults(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            honour_umask(tmp)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


KEPT = (".gitignore",)
"""Files of an output directory that belong to the repository, not to the stage's output."""


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A fresh temporary directory beside ``path`` to fill; it replaces ``path`` whole on success.

    Multi-file outputs (a train split beside a held-out split, a tokenizer, a token store) then
    appear complete or not at all: a run killed while writing leaves the old directory, or none,
    never a mix of old and new files. On an exception the temporary directory is removed.
    A ``.gitignore`` that DVC keeps inside ``path`` for its outputs is carried over.
    """
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    tmp = path.with_name(path.name + ".tmp")
    old = path.with_name(path.name + ".old")
    try:
        with machine_faults(path):
            recover_dir(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for name in KEPT:
                if (path / name).is_file():
                    shutil.copy2(path / name, tmp / name)
            yield tmp
            honour_umask(tmp)
            _swap(tmp, path, old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it, even
    back, races with another thread creating a file)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give ``path``, and all under it when it is a directory, the mode the umask gives a new
    file or directory; executable files stay executable. Links are left alone."""
    if not path.exists() or path.is_symlink():
        return
    mask = umask()
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if entry.is_symlink():
            continue
        full = 0o777 if entry.is_dir() or entry.stat().st_mode & 0o111 else 0o666
        entry.chmod(full & ~mask)


def recover_dir(path: str | Path) -> bool:
    """Put back the directory a swap moved aside, if a process was killed before the new one
    took its place (``path`` missing, ``path.old`` whole); whether it did.

    The two renames of :func:`_swap` leave that state for a moment; the next write of the
    output (:func:`atomic_dir`) calls this first, so the old output is never deleted unseen.
    """
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    old = path.with_name(path.name + ".old")
    if path.exists() or path.is_symlink() or not old.is_dir():
        return False
    old.rename(path)
    return True


def _swap(new: Path, path: Path, old: Path) -> None:
    """Put directory ``new`` at ``path``; if that fails, the directory it held goes back."""
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    try:
        new.rename(path)
    except OSError:
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    shutil.rmtree(old, ignore_errors=True)


SIGTERM_EXIT = 128 + signal.SIGTERM
"""The status a shell gives a process SIGTERM ended."""
SIGINT_EXIT = 128 + signal.SIGINT
"""Ctrl-C's exit status, as a shell reports a process the signal ended."""


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``SystemExit(143)`` instead of ending the process
    on the spot, so every ``finally`` runs: the ``.tmp`` files and directories of the atomic
    writers are removed, not left beside the outputs. Outside the main thread, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(SIGTERM_EXIT)


def write_text_atomic(path: str | Path, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` to ``path`` atomically; ``fsync`` also survives a power loss."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_json_atomic(path: str | Path, data: Any, *, sort_keys: bool = False) -> None:
    """``data`` as indented JSON with a trailing newline, written atomically.

    ``sort_keys`` stays off by default: most outputs keep their insertion order, and their
    bytes (hence DVC hashes) should not change with this helper. A NaN or infinity raises
    ``ValueError`` before anything is written: JSON has no such number, and readers choke on it.
    """
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=sort_keys, allow_nan=False) + "\n")


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks so a multi-GB checkpoint costs no memory."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def not_a_file(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as an input file, saying what it is (a phrase to follow the
    path: "does not exist", "is a directory, not a file", ...); None for a regular file."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():
        return "is not a regular file (a FIFO, socket or device)"
    if _in_link_loop(path):
        return "leads into a loop of symbolic links, so it names no file"
    if path.is_symlink():
        return f"is a link to {os.readlink(path)}, which does not exist"
    return "does not exist"


def _in_link_loop(path: Path) -> bool:
    """Whether following ``path``'s links (its own or a directory's on the way) never ends."""
    try:
        path.stat()
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def require_only(
    directory: str | Path, patterns: list[str], workspace: str | Path | None = None
) -> None:
    """Refuse to replace ``directory`` whole if it holds files no pattern names.

    Guards an output directory a user names (``--out DIR``) before ``atomic_dir`` swaps it.
    With ``workspace`` (a pipeline's directory) it also refuses what :func:`misnamed` finds.
    Every refusal is a :class:`DirectoryInUse` naming the directory and why.
    """
    directory = Path(directory)
    why = misnamed(directory, Path(workspace)) if workspace is not None else None
    if why:
        raise DirectoryInUse(f"{directory}: {why}; nothing was written")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise DirectoryInUse(f"{directory} exists and is not a directory")
    known = [*patterns, *KEPT]
    strangers = [p.name for p in directory.iterdir() if not any(p.match(g) for g in known)]
    if strangers:
        raise DirectoryInUse(
            f"{directory} holds {', '.join(sorted(strangers)[:3])}, which this writer did not "
            "make; it replaces the directory whole, so give it an empty or own directory"
        )


REPOSITORY_MARKS = ("dvc.yaml", ".dvc", ".git")
"""Entries that make a directory a repository or DVC workspace: never an output to replace."""
PIPELINE_DIRS = ("models", "data", ".dvc", ".git")
"""Directories of a workspace that its stages and tools own."""


def misnamed(directory: Path, workspace: Path) -> str | None:
    """Why ``directory`` must not be replaced by a copy of the pipeline's results, else None:
    a symbolic link (its target would be emptied), a path with no name of its own (``.``), a
    repository, the ``workspace`` or a directory above it, or one under its pipeline dirs."""
    if directory.is_symlink():
        return "is a symbolic link; name the directory itself, not a link to it"
    if directory.name in ("", ".", ".."):
        return "names no directory of its own; name a new one, e.g. ./published"
    real, home = directory.resolve(), workspace.resolve()
    if home.is_relative_to(real):
        return f"is the workspace {home} or a directory above it"
    inside = [name for name in PIPELINE_DIRS if real.is_relative_to(home / name)]
    if inside:
        return f"lies in the workspace's {inside[0]}/, which the pipeline owns"
    marks = [name for name in REPOSITORY_MARKS if (real / name).exists()]
    if marks:
        return f"holds {marks[0]}: it is a repository or DVC workspace"
    return None


def remove_files(*files: str | Path) -> None:
    """Remove outputs that are about to be rewritten together, before any new one is written.

    For an output set that spans directories (no single rename can swap it): the last file
    written then marks completion, and an interrupted run leaves it absent, never stale.
    """
    for file in files:
        Path(file).unlink(missing_ok=True)


def reset_dir(path: str | Path) -> None:
    """Empty a stage's output directory, so no file of a previous run survives beside new ones."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
