"""What ``train.topology`` and ``train.features`` choose from, listed without importing the
sources.

A feature source is a module of ``dflash.features.sources`` defining ``SOURCE``, listed from
its text as every extension point's choices are (:mod:`dflash.config.plugins`): every stage
loads the params, and importing a source's code would put it in every stage's closure. Its
``PARAM = "..."`` says which of the two params names it, read off its text the same way.
"""

from __future__ import annotations

import ast

from dflash.config import plugins

PACKAGE = "dflash.features.sources"
ATTRIBUTE = "SOURCE"

TARGET = "target"
"""``train.features: target``: a target forward per micro-batch, where ``train.topology`` says."""


def _param(module: str) -> str | None:
    """The ``PARAM`` constant of a source's module (``dflash.features.sources.<file>``)."""
    path = plugins.folder(PACKAGE) / f"{module.rpartition('.')[2]}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["PARAM"]:
            return ast.literal_eval(node.value)
    return None


def sources(param: str) -> tuple[str, ...]:
    """The sources ``param`` (``train.topology`` or ``train.features``) names, in file order."""
    found = plugins.built_in(PACKAGE, ATTRIBUTE)
    return tuple(name for name, module in found.items() if _param(module) == param)


def topologies() -> tuple[str, ...]:
    return sources("train.topology")


def feature_choices() -> tuple[str, ...]:
    """``target``, then the sources that read features made elsewhere."""
    return (TARGET, *sources("train.features"))


def chosen_by(train) -> tuple[str, str]:
    """The source a run's ``train`` params choose, and the param that names it:
    ``train.features`` unless it is ``target``, else ``train.topology``."""
    if train.features == TARGET:
        return train.topology, "train.topology"
    return train.features, "train.features"
