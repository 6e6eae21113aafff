"""Extension points found by file: a package of one module per choice, or an installed entry point.

A param that picks one (``objective.loss``, ``objective.position_weight``, ``drafter.family``)
lists the names here from the modules' source, without importing them: every stage loads the
params, and importing a choice's code (torch, the model) would put it in every stage's closure.
A module names its choice in the call that defines it (``OBJECTIVE = Loss(name="ce+kl", ...)``),
else by its file name, and its docstring's first paragraph documents it. The module that loads
choices (``load``) declares their package in ``PLUGIN_PACKAGE``, so the stages that run it
depend on every one (``dflash.pipeline.closure``). An installed package adds choices as entry
points of the group named like the package: ``name = "package.module"``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from dflash.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def folder(package: str) -> Path:
    return ROOT.joinpath(*package.split("."))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def declared_name(tree: ast.Module, attribute: str) -> str | None:
    """The ``name`` given to the call that defines ``attribute``, where it is a literal."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == [attribute]
            and isinstance(node.value, ast.Call)
        ):
            given = [k.value for k in node.value.keywords if k.arg == "name"]
            given += node.value.args[:1]
            if given and isinstance(given[0], ast.Constant) and isinstance(given[0].value, str):
                return given[0].value
    return None


@functools.cache
def built_in(package: str, attribute: str) -> dict[str, str]:
    """Each choice that comes with dflash, in file order, to its module (read once a process:
    the loader asks at every micro-batch)."""
    found = {}
    for module in pkgutil.iter_modules([str(folder(package))]):
        if module.ispkg or module.name.startswith("_"):
            continue
        tree = _tree(folder(package) / f"{module.name}.py")
        found[declared_name(tree, attribute) or module.name] = f"{package}.{module.name}"
    return found


def installed(package: str) -> dict[str, str]:
    """Each installed package's choice to the module (or object) its entry point names."""
    return {ep.name: ep.value for ep in entry_points(group=package)}


def names(package: str, attribute: str) -> tuple[str, ...]:
    """Built-in names in file order, then the installed ones (a built-in name wins)."""
    own = tuple(built_in(package, attribute))
    return own + tuple(sorted(set(installed(package)) - set(own)))


def choices(package: str, attribute: str) -> Callable[[], tuple[str, ...]]:
    """``names`` of ``package``, asked when params are validated (``types.one_of``)."""
    return functools.partial(names, package, attribute)


def docs(package: str, attribute: str) -> dict[str, str]:
    """Each choice's first docstring paragraph, on one line (built-in ones read, not imported)."""
    found = {}
    for name, module in built_in(package, attribute).items():
        text = ast.get_docstring(_tree(folder(package) / f"{module.rpartition('.')[2]}.py"))
        found[name] = text or ""
    for name, value in installed(package).items():
        if name not in found:
            found[name] = importlib.import_module(value.partition(":")[0]).__doc__ or ""
    return {name: " ".join(text.split("\n\n")[0].split()) for name, text in found.items()}


def load(package: str, attribute: str, name: str, kind: type, key: str) -> Any:
    """The ``kind`` that choice ``name`` of ``package`` defines as ``attribute``; a
    ``ConfigError`` naming ``key`` and the allowed names otherwise."""
    own = built_in(package, attribute)
    if name in own:
        found: Any = importlib.import_module(own[name])
    else:
        points = entry_points(group=package, name=name)
        if not points:
            allowed = ", ".join(map(repr, names(package, attribute)))
            raise ConfigError(f"{key} = {name!r}: allowed values are {allowed}")
        found = next(iter(points)).load()
    defined = getattr(found, attribute, None) if isinstance(found, ModuleType) else found
    if not isinstance(defined, kind) or defined.name != name:
        raise ConfigError(
            f"{key} = {name!r}: its module must define "
            f"{attribute} = {kind.__name__}(name={name!r}, ...)"
        )
    return defined
