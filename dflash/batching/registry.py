"""Every batching strategy by name, loaded from its module (``dflash.batching.choices``).

``PLUGIN_PACKAGE`` tells ``dflash.pipeline.closure`` that this module imports every module of the
package, so a stage that plans depends on all the built-in strategies' code.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from types import ModuleType

from dflash.batching.choices import ENTRY_POINT_GROUP, built_in_strategies, strategy_names
from dflash.batching.errors import BatchingError
from dflash.batching.strategy import Strategy

PLUGIN_PACKAGE = "dflash.batching.strategies"


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; a ``BatchingError`` naming the allowed ones otherwise."""
    if name in built_in_strategies():
        found = importlib.import_module(f"{PLUGIN_PACKAGE}.{name}")
    else:
        points = entry_points(group=ENTRY_POINT_GROUP, name=name)
        if not points:
            allowed = ", ".join(strategy_names())
            raise BatchingError(f"strategy {name!r}: allowed are {allowed}")
        found = next(iter(points)).load()
    defined = found.STRATEGY if isinstance(found, ModuleType) else found
    if not isinstance(defined, Strategy) or defined.name != name:
        raise BatchingError(
            f"strategy {name!r}: its module must define STRATEGY = Strategy(name={name!r}, ...)"
        )
    return defined


def strategies() -> dict[str, Strategy]:
    """All of them, in ``strategy_names`` order."""
    return {name: strategy(name) for name in strategy_names()}
