"""A run's files at its own revision: DVC experiments are git refs, so git reads them.

``dvc exp run`` commits every output declared ``cache: false`` (the metrics, the per-prompt
records, ``params.yaml``) under ``refs/exps/<baseline[:2]>/<baseline[2:]>/<name>``, so a run
named by its experiment or by any git revision is read with ``git show REV:path``, without
DVC and without checking anything out. The workspace is read from disk.
"""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash.errors import UserError
from dflash.eval.records import COLUMNS, read_records
from dflash.pipeline.workspace import RELATIVE

WORKSPACE = "workspace"
"""The name of the uncommitted run in the working tree."""


@dataclass
class Run:
    name: str
    rev: str | None
    """The commit the files are read from; None: the working tree."""
    params: dict[str, Any] = field(default_factory=dict)
    """Every param as a dotted key."""
    records: list[dict] = field(default_factory=list)
    train: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if self.rev is None else f"{self.name} ({self.rev[:7]})"


def git(root: Path, *args: str) -> str | None:
    """git's output in ``root``; None when git refuses."""
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def resolve(root: Path, name: str) -> str:
    """The commit of an experiment (the one of the current baseline first) or a revision."""
    refs = git(root, "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps") or ""
    experiments = [line.split() for line in refs.splitlines() if line.count("/") == 4]
    found = [(sha, ref) for sha, ref in experiments if ref.rsplit("/", 1)[-1] == name]
    head = (git(root, "rev-parse", "HEAD") or "").strip()
    here = [sha for sha, ref in found if head and f"/{head[:2]}/{head[2:]}/" in ref]
    if here or len(found) == 1:
        return (here or [found[0][0]])[0]
    if found:
        raise UserError(f"experiment {name} exists under {len(found)} baselines: name a commit")
    sha = git(root, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")
    if sha is None:
        raise UserError(f"no experiment or git revision named {name}")
    return sha.strip()


def read_text(root: Path, rev: str | None, relative: Path) -> str | None:
    """A file at ``rev`` (the working tree when None); None when absent."""
    if rev is None:
        path = root / relative
        return path.read_text() if path.is_file() else None
    return git(root, "show", f"{rev}:./{relative.as_posix()}")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def where_of(run: Run) -> str:
    return "the workspace" if run.rev is None else run.label


NUMBERS = {"tau": float, "ngram_tau": float, "prompt": int, "tokens": int}
"""The columns of the per-prompt records that hold numbers (``tau`` and ``ngram_tau`` may be
empty: a prompt without a verification step)."""


def checked_records(text: str, where: str) -> str:
    """``text`` if every record has every column and a finite number where one goes; else a
    :class:`UserError` naming ``where`` (the file) and the line."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{where} has no column {missing[0]} (the header names "
                        f"{', '.join(reader.fieldnames or []) or 'none'})")  # fmt: skip
    for row in reader:
        for column, kind in NUMBERS.items():
            value = row[column]
            if value == "" and kind is float:
                continue
            try:
                number = kind(value)
            except (TypeError, ValueError):
                number = None
            if number is None or not math.isfinite(number):
                what = "a finite number" if kind is float else "a whole number"
                raise UserError(f"{where}, line {reader.line_num}: {column} = {value!r} is not "
                                f"{what}; evaluate the run again")  # fmt: skip
    return text


def load_run(root: Path, name: str, rev: str | None) -> Run:
    """A run's params, per-prompt records and training details; the records must exist."""
    run = Run(name, rev)
    where = where_of(run)
    records = read_text(root, rev, RELATIVE.eval_prompts)
    if records is None:
        raise UserError(
            f"{where} has no {RELATIVE.eval_prompts}: evaluate it first (dvc repro, or dvc exp run)"
        )
    run.records = read_records(checked_records(records, f"{where}'s {RELATIVE.eval_prompts}"))
    params = read_text(root, rev, Path("params.yaml"))
    run.params = flatten(_parsed(yaml.safe_load, params, f"{where}'s params.yaml"))
    details = read_text(root, rev, RELATIVE.train_details)
    run.train = _parsed(json.loads, details, f"{where}'s {RELATIVE.train_details}")
    return run


def _parsed(parse, text: str | None, where: str) -> dict[str, Any]:
    """``text`` parsed as a mapping (absent or empty: an empty one); else a UserError."""
    try:
        data = parse(text) if text else {}
    except (ValueError, yaml.YAMLError) as err:
        why = " ".join(str(err).split())  # one line, as YAML's marks are not
        raise UserError(f"{where} does not parse ({type(err).__name__}: {why})") from None
    if not isinstance(data, dict | None):
        raise UserError(f"{where} holds a {type(data).__name__}, not a mapping")
    return data or {}


def runs_to_compare(root: Path, names: list[str]) -> list[Run]:
    """The runs named, the first the reference. None named: the workspace against its
    baseline (HEAD); one: that experiment against the commit it was run from."""
    if not names:
        head = resolve(root, "HEAD")
        return [load_run(root, "HEAD", head), load_run(root, WORKSPACE, None)]
    revs = [resolve(root, n) for n in names]
    if len(names) == 1:
        parent = resolve(root, f"{revs[0]}^")
        return [load_run(root, "baseline", parent), load_run(root, names[0], revs[0])]
    return [load_run(root, n, r) for n, r in zip(names, revs, strict=True)]
