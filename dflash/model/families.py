"""Drafter families by name: ``drafter.family``, and any export read back by its own family.

It names a module of ``dflash.drafters`` (or an installed plug-in) that defines
``DRAFTER = Family(name=..., ...)``; :func:`family` loads it. An export names its family by
the ``architectures`` of its ``config.json``, which :func:`load_drafter` reads it back by.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from dflash.config import plugins
from dflash.drafters import Family
from dflash.errors import ConfigError
from dflash.model import hf_files

PLUGIN_PACKAGE = "dflash.drafters"
ATTRIBUTE = "DRAFTER"
KEY = "drafter.family"


def family(name: str) -> Family:
    """The family ``drafter.family = name`` picks."""
    return plugins.load(PLUGIN_PACKAGE, ATTRIBUTE, name, Family, KEY)


def families() -> dict[str, Family]:
    return {name: family(name) for name in plugins.names(PLUGIN_PACKAGE, ATTRIBUTE)}


def family_of(directory: Path) -> Family:
    """The family whose architecture an export's ``config.json`` names."""
    data = json.loads((Path(directory) / hf_files.CONFIG).read_text())
    named = (data.get("architectures") or [None])[0]
    for found in families().values():
        if found.architecture == named:
            return found
    known = ", ".join(f"{f.architecture} ({f.name})" for f in families().values())
    raise ConfigError(f"{directory}: architectures names {named!r}; the families know {known}")


def load_drafter(directory: Path, target: nn.Module) -> nn.Module:
    """The drafter an export holds, read by its own family."""
    return family_of(directory).load(Path(directory), target)
