"""The weighting of block slots by name: ``objective.position_weight``.

It names a module of ``dflash.objectives.weights`` (or an installed plug-in) that defines
``POSITION_WEIGHT = PositionWeight(name=..., ...)``; :func:`position_weight` loads it.
"""

from __future__ import annotations

from dflash.config import plugins
from dflash.objectives.weights import PositionWeight

PLUGIN_PACKAGE = "dflash.objectives.weights"
ATTRIBUTE = "POSITION_WEIGHT"
KEY = "objective.position_weight"


def position_weight(name: str) -> PositionWeight:
    """The weighting ``objective.position_weight = name`` picks."""
    return plugins.load(PLUGIN_PACKAGE, ATTRIBUTE, name, PositionWeight, KEY)
