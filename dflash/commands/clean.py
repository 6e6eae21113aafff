"""``dflash clean``: list the runs whose checkpoints a workspace keeps, and remove them.

Each run (params, data, code: its fingerprint) keeps its checkpoints in a directory of its own
under ``checkpoints/`` (:mod:`dflash.train.checkpointing.checkpoint`), so a run with other params
never
removes an interrupted one's. ``train.keep_runs`` bounds how many stay; this command shows
them, marks the one the current params would resume, and removes what the user names. It
takes the workspace's lock, and a run's own lock before removing it: a run that a live process
trains, in this workspace or another sharing ``train.checkpoint_dir``, is kept, and said so.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash.config.schema import Config
from dflash.errors import UserError
from dflash.pipeline.declaration import unrestricted
from dflash.pipeline.lock import workspace_lock
from dflash.pipeline.workspace import Workspace

SHOWN_PARAMS = ("batching.strategy", "train.lr", "train.epochs", "train.world_size", "train.seed")
"""The params a run's line shows: what usually tells two experiments apart."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--remove", nargs="+", metavar="RUN", help="remove these runs (ids)")
    which.add_argument("--keep", type=int, metavar="N", help="keep the N most recent runs")
    which.add_argument("--all", action="store_true", help="remove every run's checkpoints")


def run(config: Config, workspace: Workspace, options: argparse.Namespace) -> int:
    from dflash.stages.train import train_files
    from dflash.train.checkpointing.checkpoint import remove_run, run_directories

    root = train_files(workspace, unrestricted(config)).checkpoints
    with workspace_lock(workspace.lock, "clean"):
        runs = run_directories(root)
        removed = []
        for path in _chosen(runs, options):
            size = _size(path)
            why = remove_run(path)
            if why is None:
                removed.append(path)
                print(f"removed run {path.name} ({size})")
            else:
                print(f"kept run {path.name}: {why}")
        kept = [path for path in runs if path not in removed]
        print(_listing(kept, _current(config, workspace), root))
    return 0


def _chosen(runs: list[Path], options: argparse.Namespace) -> list[Path]:
    if options.all:
        return runs
    if options.keep is not None:
        if options.keep < 0:
            raise UserError(f"--keep must be >= 0, got {options.keep}")
        return runs[options.keep :]
    if options.remove:
        by_id = {path.name: path for path in runs}
        unknown = [name for name in options.remove if not _match(name, by_id)]
        if unknown:
            raise UserError(f"no run {', '.join(unknown)}; the runs are: {', '.join(by_id)}")
        return [path for name in options.remove for path in [_match(name, by_id)]]
    return []


def _match(prefix: str, by_id: dict[str, Path]) -> Path | None:
    """The run whose id starts with ``prefix``, when exactly one does."""
    found = [path for name, path in by_id.items() if name.startswith(prefix)]
    return found[0] if len(found) == 1 else None


def _current(config: Config, workspace: Workspace) -> str | None:
    """The id of the run the current params resume, or None when its inputs are not there."""
    from dflash.stages.train import fingerprint
    from dflash.train.checkpointing.checkpoint import RUN_ID_CHARS

    try:
        return fingerprint(unrestricted(config), workspace)[:RUN_ID_CHARS]
    except (OSError, UserError, ValueError):
        return None


def _listing(runs: list[Path], current: str | None, root: Path) -> str:
    from dflash.train.checkpointing.checkpoint import (
        last_written,
        list_checkpoints,
        read_run_info,
        step_of,
    )

    if not runs:
        return f"no runs under {root}"
    lines = [f"{len(runs)} run(s) under {root}, the most recently written first:"]
    for path in runs:
        steps = [step_of(p) for p in list_checkpoints(path)]
        newest = f"step {max(steps)}" if steps else "no checkpoint"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(last_written(path)))
        params = read_run_info(path).get("params", {})
        shown = " ".join(f"{key}={_param(params, key)}" for key in SHOWN_PARAMS)
        mark = "  <- the current params" if path.name == current else ""
        lines.append(f"  {path.name}  {when}  {newest:>12}  {_size(path):>9}  {shown}{mark}")
    return "\n".join(lines)


def _param(params: dict, key: str) -> str:
    section, _, name = key.partition(".")
    return str(params.get(section, {}).get(name, "?"))


def _size(path: Path) -> str:
    total = sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    for unit in ("B", "KiB", "MiB", "GiB"):
        if total < 1024 or unit == "GiB":
            return f"{total:.0f} {unit}" if unit == "B" else f"{total:.1f} {unit}"
        total /= 1024
    return f"{total:.1f} TiB"
