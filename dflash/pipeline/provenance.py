"""Which params made each output: a stage run by hand refuses inputs made from other ones.

``dvc repro`` reruns every stage whose params changed, so its inputs always match. A stage run
by hand does not: ``dflash plan --set data.source=other.jsonl`` after a tokenize that refused
that source would plan the old token store and train on it silently. So, like the drafter's
digest in ``metrics/train_details.json`` (:mod:`dflash.pipeline.freshness`), every stage records
what
it wrote: the params that decided it, its own and, transitively, those recorded for its
inputs, beside a signature of the files it wrote: their contents' digests, cached by inode,
size and times in ``DIGESTS`` so that an unchanged file is not read again. A stage about to run
compares each input's record with the params it is given, and a difference exits 2 naming the
input, the param, both values and the command that remakes it.

An input whose contents no longer match its record (another version restored by ``dvc
checkout``, an experiment applied) or that has none proves nothing either way and passes, as
the freshness check passes metrics without a digest. A copy of the same files (``cp -r``,
``tar``, ``rsync``, times rounded or not) still matches: it is read again, never trusted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.config.params import set_option
from dflash.config.schema import Config
from dflash.errors import UserError
from dflash.fileio import write_json_atomic
from dflash.pipeline.declaration import declared_params, restrict, stages, unrestricted
from dflash.pipeline.fingerprint import DigestCache, digest
from dflash.pipeline.workspace import Workspace

DIGESTS = "digests.json"
"""Beside the records: the digests of the files they sign (:class:`DigestCache`)."""


class StaleInput(UserError):
    """An input was made from other params than the stage is given."""


def check(stage: str, config: Config, workspace: Workspace) -> None:
    """Raise ``StaleInput`` when an input of ``stage`` was made from other params."""
    given = _flat(declared_params(unrestricted(config)))
    problems = []
    cache = DigestCache(workspace.provenance / DIGESTS)
    for producer, output in _inputs(stage):
        made = _valid_record(producer, workspace, cache)
        for key, value in (made or {}).items():
            if key in given and _plain(given[key]) != _plain(value):
                problems.append((output, producer, key, value, given[key]))
    cache.save()
    if problems:
        output, producer, key, value, now = problems[0]
        first = _first_declaring(key) or producer
        raise StaleInput(
            f"stale input: {output} was made with {key} = {value!r}, but this run has "
            f"{key} = {now!r}; remake it with `dflash {first}` and the stages after it, given "
            f"`{set_option(key, now)}` (or that value in params.yaml), or "
            f"`dvc repro {stage}` for all of them"
            + (f" ({len(problems) - 1} more difference(s))" if len(problems) > 1 else "")
        )


def record(stage: str, config: Config, workspace: Workspace) -> None:
    """After ``stage`` wrote its outputs whole: what made them, and their signature."""
    made: dict[str, Any] = {}
    cache = DigestCache(workspace.provenance / DIGESTS)
    for producer, _ in _inputs(stage):
        made |= _valid_record(producer, workspace, cache) or {}
    declared = stages()[stage]
    made |= _flat(declared_params(restrict(unrestricted(config), declared.params)))
    entry = {"params": made, "signature": _signature(workspace, declared.writes, cache)}
    write_json_atomic(_record_path(workspace, stage), entry, sort_keys=True)
    cache.save()


def _valid_record(stage: str, workspace: Workspace, cache: DigestCache) -> dict[str, Any] | None:
    """The params recorded for ``stage``'s outputs, when the files are still the ones it wrote."""
    try:
        entry = json.loads(_record_path(workspace, stage).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("signature") != _signature(
        workspace, stages()[stage].writes, cache
    ):
        return None
    params = entry.get("params")
    return params if isinstance(params, dict) else None


def _inputs(stage: str) -> list[tuple[str, str]]:
    """(producing stage, path) for each input of ``stage`` that another stage writes."""
    found = []
    for read in stages()[stage].reads:
        for name, other in stages().items():
            if name != stage and any(_overlap(read, out) for out in other.writes):
                found.append((name, read))
    return found


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _first_declaring(key: str) -> str | None:
    """The earliest stage of the pipeline that declares ``key``: where a remake starts."""
    for name, stage in stages().items():
        if any(key == p or key.startswith(p + ".") for p in stage.params):
            return name
    return None


def _signature(workspace: Workspace, paths: tuple[str, ...], cache: DigestCache) -> str:
    """The contents of the files under ``paths``, by name: what a record vouches for."""
    files = {}
    for relative in paths:
        path = workspace.root / relative
        found = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in found:
            if file.is_file():
                files[str(file.relative_to(workspace.root))] = cache.file(file)
    return digest(files)


def _record_path(workspace: Workspace, stage: str) -> Path:
    return workspace.provenance / f"{stage}.json"


def _flat(params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{name}.{key}": value for name, keys in params.items() for key, value in keys.items()}


def _plain(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
