"""Atomic, verified checkpoints of named ``Stateful`` parts, through torch.distributed.checkpoint.

The caller hands over the parts (``TrainState``, drafter, optimizer, scheduler: anything with
``state_dict``/``load_state_dict``); this module knows nothing of the trainer. Every rank writes
its own shards into a temporary directory, which rank 0 fsyncs and renames, and the SHA-256 of
the directory is written beside it last; one without a matching digest (killed mid-write,
truncated, bit-rotted) is skipped on resume and the one before it is used. A
``run_fingerprint`` of everything the weights depend on (params, token contents, plans,
target, tokenizer, code) keeps a rerun from resuming a checkpoint of another run, and names
the run's own directory under the checkpoint root: a run with other params writes beside an
interrupted one and never removes it, so going back to the first params resumes it. Only
``prune_runs`` removes another run's checkpoints, the least recently written past a bound, and
never one a live process trains: each run holds a lock in its own directory (``RUN_LOCK``).
Checkpoints hold tensors and plain types only and are read without running pickled code
(:mod:`dflash.train.checkpointing.dcp_safe`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dflash.errors import UserError
from dflash.fileio import write_text_atomic
from dflash.model.load import target_digest
from dflash.pipeline.fingerprint import digest, path_digest
from dflash.train.checkpointing.dcp_safe import SafeLoadPlanner, SafeReader
from dflash.train.distributed.process_group import Dist, barrier
from dflash.train.run_files import TrainFiles

CHECKPOINT_NAME = "step_{step:08d}"
"""A checkpoint directory: ``torch.distributed.checkpoint`` shards and index, and CHECKPOINT_RUN."""
CHECKPOINT_GLOB = "step_" + "[0-9]" * 8
CHECKPOINT_RUN = "run.json"
"""In a checkpoint directory: the run fingerprint and step, read before any shard; in a run's
directory: its fingerprint and declared params, for ``dflash clean`` to list."""
RUN_ID_CHARS = 16
"""A run's directory is named by the first hex digits of its fingerprint (64 bits)."""
PLACEMENT_PARAMS = ("topology", "target_ranks")
"""``train`` params that place the target, not change the weights: a colocated and a decoupled
run of one plan compute the same steps, so each resumes the other's checkpoints."""

logger = logging.getLogger(__name__)


HEX = frozenset("0123456789abcdef")


RUN_LOCK = "run.lock"
"""In a run's directory: locked by the process training the run for its whole life, and briefly
by one removing the run. A checkpoint root that workspaces share (``train.checkpoint_dir``) is
beyond each workspace's lock: this one keeps ``prune_runs`` and ``dflash clean`` off a run that
another workspace is training. A POSIX record lock (``lockf``), not ``flock``: forked loader
workers do not inherit it, so the kernel drops it the moment the training process dies."""
REMOVING = "removing"
"""What a process removing a run writes in its lock: a start of that run waits for it."""

_held: dict[Path, int] = {}
"""The runs this process trains, and their lock's file descriptor."""


class RunBusy(UserError):
    """A live process trains this very run in a shared checkpoint root (exit 2)."""


def run_directory(root: Path, fingerprint: str) -> Path:
    """Where the run of ``fingerprint`` keeps its checkpoints, under the checkpoint root."""
    return root / fingerprint[:RUN_ID_CHARS]


def run_directories(root: Path) -> list[Path]:
    """Every run's directory under ``root``, the most recently written first."""
    if not root.is_dir():
        return []
    runs = [
        p
        for p in root.iterdir()
        if p.is_dir() and len(p.name) == RUN_ID_CHARS and all(c in HEX for c in p.name)
    ]
    return sorted(runs, key=last_written, reverse=True)


def last_written(run: Path) -> float:
    """When a run last wrote anything: its newest entry's modification time (a link's own, so
    a dangling one counts too); 0 for a run removed meanwhile."""
    try:
        return max((p.lstat().st_mtime for p in run.iterdir()), default=run.stat().st_mtime)
    except FileNotFoundError:
        return 0.0


def hold_run(run: Path) -> None:
    """Lock ``run`` for this process until :func:`release_runs` or its death: a run that
    another process trains is refused, one that another process removes is waited for."""
    if run in _held:
        return
    while True:
        run.mkdir(parents=True, exist_ok=True)
        fd = _open_lock(run)
        try:
            holder = _try_lock(fd)
        except OSError as err:  # a file system without locks: train unguarded, and say so
            os.close(fd)
            logger.warning(
                f"{run / RUN_LOCK} cannot be locked ({err.strerror}): another "
                "workspace sharing train.checkpoint_dir could prune this run"
            )
            return
        if holder is not None and not holder.endswith(REMOVING):
            os.close(fd)
            raise RunBusy(
                f"{run}: this run is being trained by {_describe(holder)}, which shares "
                "train.checkpoint_dir with this workspace; wait for it to end, or set another "
                "train.checkpoint_dir"
            )
        if holder is not None:
            fcntl.lockf(fd, fcntl.LOCK_EX)  # the remover ends soon: the directory is then gone
        if _still_there(fd, run):
            break
        os.close(fd)
    _stamp(fd, "train")
    _held[run] = fd


def release_runs() -> None:
    """Unlock every run this process holds."""
    while _held:
        _, fd = _held.popitem()
        fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)


def remove_run(run: Path) -> str | None:
    """Remove ``run`` whole unless a live process holds its lock; why it was kept, else None."""
    try:
        fd = _open_lock(run)
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as err:
        return f"its lock {run / RUN_LOCK} cannot be opened ({err.strerror})"
    try:
        holder = _try_lock(fd)
        if holder is not None:
            return f"in use by {_describe(holder)}"
        _stamp(fd, REMOVING)
        shutil.rmtree(run)
    except OSError as err:
        return f"not removed whole ({err.strerror}{f': {err.filename}' if err.filename else ''})"
    finally:
        os.close(fd)
    return None


def _open_lock(run: Path) -> int:
    return os.open(run / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)


def _try_lock(fd: int) -> str | None:
    """None when this process now holds the lock of ``fd``, else what its holder wrote."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    return None


def _still_there(fd: int, run: Path) -> bool:
    """Whether the lock of ``fd`` is still the one in ``run`` (a remover may have unlinked it)."""
    try:
        found = (run / RUN_LOCK).lstat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


def _stamp(fd: int, doing: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {doing}\n".encode(), 0)


def _describe(holder: str) -> str:
    pid, host, doing = (holder.split(maxsplit=2) + ["?", "?", "?"])[:3]
    if not pid.isdigit():
        return "another process"
    return f"PID {pid} on {host}" + (", removing it" if doing == REMOVING else "")


def prune_runs(root: Path, keep: int, current: Path) -> list[Path]:
    """Remove the least recently written runs past ``keep``, never ``current`` nor one a live
    process holds (said in the log); the removed."""
    removed = []
    for run in [run for run in run_directories(root) if run != current][max(keep - 1, 0) :]:
        why = remove_run(run)
        if why is None:
            removed.append(run)
        else:
            logger.warning(f"kept the checkpoints of run {run.name} past train.keep_runs: {why}")
    return removed


def start_run(root: Path, fingerprint: str, params: dict[str, Any], keep_runs: int) -> Path:
    """This run's directory, locked and described for ``dflash clean``; runs past ``keep_runs``
    pruned.

    Rank 0 only; :func:`release_runs` unlocks it. The description is written once and touched
    at every start, so a resumed run counts as recently written however old its checkpoints are.
    """
    run = run_directory(root, fingerprint)
    hold_run(run)
    info = json.dumps({"fingerprint": fingerprint, "params": params}, indent=2, sort_keys=True)
    write_text_atomic(run / CHECKPOINT_RUN, info + "\n")
    for old in prune_runs(root, keep_runs, run):
        logger.info(f"removed the checkpoints of run {old.name} (train.keep_runs = {keep_runs})")
    return run


def read_run_info(run: Path) -> dict[str, Any]:
    """A run directory's description; empty when it is missing or unreadable."""
    try:
        info = json.loads((run / CHECKPOINT_RUN).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / CHECKPOINT_NAME.format(step=step)


def step_of(path: Path) -> int:
    return int(path.name.rpartition("_")[2])


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint directories, newest (highest step) first."""
    if not directory.exists():
        return []
    return sorted((p for p in directory.glob(CHECKPOINT_GLOB) if p.is_dir()), reverse=True)


def remove_checkpoint(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _digest_path(path).unlink(missing_ok=True)


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest checkpoints (``train.keep_checkpoints``)."""
    for old in list_checkpoints(directory)[keep:]:
        remove_checkpoint(old)


def remove_checkpoints(directory: Path) -> None:
    """Every checkpoint, digest and unfinished write; other files (a lock) are left alone."""
    for path in directory.glob("step_*"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group: dist.ProcessGroup | None) -> None:
    if _distributed():
        dist.barrier(group=group)


def _broadcast(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (itself without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def save_checkpoint(
    directory: Path,
    step: int,
    parts: Mapping[str, Any],
    fingerprint: str,
    keep: int,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write ``parts`` as checkpoint ``step`` whole or not at all (collective: the ranks of
    ``group``, all of them when None, call it; global rank 0 is among them and writes)."""
    path = checkpoint_path(directory, step)
    tmp = path.with_name(path.name + ".tmp")
    main = not _distributed() or dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)  # the directory exists before any rank writes into it
    writer = dcp.FileSystemWriter(tmp, sync_files=True)
    dcp.save(dict(parts), storage_writer=writer, process_group=group)
    if main:
        info = json.dumps({"fingerprint": fingerprint, "step": step})
        write_text_atomic(tmp / CHECKPOINT_RUN, info, fsync=True)
        _fsync(tmp)
        remove_checkpoint(path)
        tmp.rename(path)
        _fsync(directory)
        write_text_atomic(_digest_path(path), path_digest(path), fsync=True)
        _fsync(directory)
        prune_checkpoints(directory, keep)
    _barrier(group)
    return path


def _intact(path: Path, fingerprint: str) -> str | None:
    """Why checkpoint ``path`` cannot be resumed by this run, or None when it can."""
    digest_file = _digest_path(path)
    if not digest_file.exists():
        return "no digest (write did not finish)"
    if digest_file.read_text().strip() != path_digest(path):
        return "digest mismatch (truncated or corrupt)"
    try:
        info = json.loads((path / CHECKPOINT_RUN).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable run info ({type(err).__name__})"
    if info.get("fingerprint") != fingerprint:
        return "belongs to another run (params, plan or data differ)"
    return None


def _candidates(directory: Path, fingerprint: str) -> tuple[list[Path], list[str]]:
    usable, skipped = [], []
    for path in list_checkpoints(directory):
        reason = _intact(path, fingerprint)
        if reason is None:
            usable.append(path)
        else:
            skipped.append(f"{path.name}: {reason}")
    return usable, skipped


def load_latest(
    directory: Path,
    fingerprint: str,
    parts: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
) -> tuple[int | None, list[str]]:
    """Load the newest intact checkpoint of this run into ``parts`` (collective).

    Returns its step, or None, and why each newer one was passed over. Rank 0 checks the
    digests and fingerprints (one read of the files, not one per rank) and tells the others.
    """
    usable, skipped = _broadcast(_candidates(directory, fingerprint), group)
    for path in usable:
        reader, planner = SafeReader(path), SafeLoadPlanner()
        try:
            dcp.load(dict(parts), storage_reader=reader, planner=planner, process_group=group)
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - skipped, and said so
            skipped.append(f"{path.name}: unreadable ({type(err).__name__}: {err})"[:500])
            continue
        return step_of(path), skipped
    return None, skipped


def run_fingerprint(files: TrainFiles, declared: dict[str, Any]) -> str:
    """Everything the trained weights depend on; a checkpoint resumes only into the same run.

    Contents, not counts: a tokenizer fix that keeps every length changes the token store's
    bytes and so the fingerprint. The params are the ones ``train`` declares (its knobs
    change no weight); the code is the train stage's import closure (``declared``, from
    ``dflash.pipeline.closure.declared_inputs``). The placement of the target is left out
    (``PLACEMENT_PARAMS``).
    """
    params = declared.get("params", {})
    train = {k: v for k, v in params.get("train", {}).items() if k not in PLACEMENT_PARAMS}
    return digest(
        declared
        | {"params": params | ({"train": train} if "train" in params else {})}
        | {
            "tokens": path_digest(files.tokenized),
            "plans": path_digest(files.plans),
            "target": target_digest(files.target),
            "tokenizer": path_digest(files.tokenizer),
        }
    )


def resume(ctx: Dist, parts: Mapping[str, Any], fingerprint: str, directory: Path) -> int | None:
    """Load the newest intact checkpoint of this run from its own ``directory`` into ``parts``
    (its step), or start fresh; other runs' directories are not read or touched."""
    step, skipped = load_latest(directory, fingerprint, parts, ctx.group)
    if ctx.is_main:
        for reason in skipped:
            logger.info(f"skipping checkpoint {reason}")
    if step is None and any("unreadable (" in reason for reason in skipped):
        raise RuntimeError(
            "a checkpoint of this run passed its digest but could not be loaded, and loading "
            f"may have changed the drafter in part; remove {directory} to start fresh"
        )
    if ctx.is_main and step is None:
        logger.info(f"no checkpoint of this run: starting fresh in {directory}")
        remove_checkpoints(directory)
    if ctx.is_main and step is not None:
        # Newer ones passed over (unfinished, corrupt, another run's) would otherwise be
        # counted as "newest" when pruning and crowd out the checkpoints this run writes.
        for path in list_checkpoints(directory):
            if step_of(path) > step:
                remove_checkpoint(path)
    barrier(ctx)
    return step
