"""What each stage is, read from the one place it is declared: ``dvc.yaml``.

A stage's ``params`` decide what it writes, so DVC reruns it when one changes. Its
``meta.knobs`` change only how it runs (workers, checkpoint cadence, logging sinks): read,
never rerun for. ``meta.entry`` names the library function that runs it. A stage gets its
params and knobs and nothing else (``restrict``): a param read but not declared would be a
silent staleness bug, so reading one raises at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from dflash.config.params import parse_yaml
from dflash.config.schema import Config

DVC_YAML = Path(__file__).resolve().parents[2] / "dvc.yaml"
"""The project's pipeline, beside the package (an editable install, as ``make`` sets up)."""

COMMANDS = {"report": "dflash.commands.report:run", "clean": "dflash.commands.clean:run"}
"""Commands that are no pipeline stage: they read no params and write no DVC output."""


@dataclass(frozen=True)
class Stage:
    name: str
    entry: str
    """``module:function`` that runs the stage on its restricted ``Config`` and its workspace."""
    params: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    """The data it reads (its deps that are no code), relative to the workspace."""
    writes: tuple[str, ...] = ()
    """Its outputs, metrics and plots, relative to the workspace."""

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]


@cache
def pipeline() -> dict[str, dict]:
    """The stages of ``dvc.yaml`` as written (duplicate keys refused, as in params files)."""
    if not DVC_YAML.is_file():
        raise FileNotFoundError(2, "the pipeline declaration is missing", str(DVC_YAML))
    return parse_yaml(DVC_YAML.read_text(), str(DVC_YAML))["stages"]


@cache
def stages() -> dict[str, Stage]:
    """Every command by name: the stages of ``dvc.yaml``, then ``COMMANDS``."""
    found = {}
    for name, body in pipeline().items():
        meta = body.get("meta") or {}
        found[name] = Stage(
            name,
            meta["entry"],
            tuple(body.get("params", ())),
            tuple(meta.get("knobs", ())),
            tuple(d for d in body.get("deps", ()) if not _is_code(d)),
            tuple(_path(o) for key in ("outs", "metrics", "plots") for o in body.get(key, ())),
        )
    return found | {name: Stage(name, entry) for name, entry in COMMANDS.items()}


def _is_code(dep: str) -> bool:
    return dep.endswith(".py") or dep.startswith("dflash/")


def _path(entry: str | dict) -> str:
    """An out as ``dvc.yaml`` writes it: a path, or a path with its options."""
    return entry if isinstance(entry, str) else next(iter(entry))


def restrict(config: Config, allowed: Iterable[str]) -> Config:
    """``config`` holding only the ``allowed`` dotted keys (a section name allows all of it).

    The result is a real ``Config``: the others are removed from its sections, so reading one
    raises ``UndeclaredParamError`` (``dflash.config.schema.Section.__getattr__``).
    """
    allowed = frozenset(allowed)
    sections = {}
    for name, section in config:
        keep = {k: v for k, v in section.__dict__.items() if _covered(f"{name}.{k}", allowed)}
        view = type(section).model_construct(**keep)
        for key in set(view.__dict__) - set(keep):
            del view.__dict__[key]
        sections[name] = view
    view = Config.model_construct(**sections)
    view._unrestricted = unrestricted(config)
    return view


def unrestricted(config: Config) -> Config:
    """All params behind a ``restrict``-ed view: to hand on to a child process, which restricts
    them again, never to read."""
    return config._unrestricted or config


def declared_params(config: Config) -> dict[str, dict[str, Any]]:
    """The params ``config`` holds, by section, in plain types: what a run logs and hashes."""
    out = {}
    for name, section in config:
        values = {k: v for k, v in section.__dict__.items() if k in type(section).model_fields}
        if values:
            out[name] = (
                type(section).model_construct(**values).model_dump(mode="json", include=set(values))
            )
    return out


def _covered(key: str, allowed: frozenset[str]) -> bool:
    return key in allowed or any(key.startswith(a + ".") for a in allowed)
