"""What the batching params choose from, listed without importing the code behind a choice.

The params schema reads these names and every stage loads the params, so listing them here,
not importing the strategies, keeps each strategy's code out of the other stages' closures.
A strategy is a module of ``dflash.batching.strategies`` named after it, or an entry point of
the ``dflash.batching.strategies`` group in an installed package (``dflash.batching.registry``
loads either).
"""

from __future__ import annotations

import pkgutil
from importlib.metadata import entry_points
from pathlib import Path

BOUNDARY_METHODS = ("optimal", "quantile", "token_mass")
"""How ``bucketed`` draws bucket edges; ``dflash.batching.boundaries`` defines
``<method>_boundaries`` for each."""

ENTRY_POINT_GROUP = "dflash.batching.strategies"
"""Where an installed package declares its strategies: ``name = "package.module"``."""

BUILT_IN = Path(__file__).with_name("strategies")
"""The folder of the strategies that come with dflash, one module each."""


def built_in_strategies() -> tuple[str, ...]:
    return tuple(m.name for m in pkgutil.iter_modules([str(BUILT_IN)]) if m.name[0] != "_")


def installed_strategies() -> dict[str, str]:
    """Each installed package's strategy name to the module (or object) its entry point names."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def strategy_names() -> tuple[str, ...]:
    """Built-in names in file order, then the installed ones (a built-in name wins)."""
    built_in = built_in_strategies()
    return built_in + tuple(sorted(set(installed_strategies()) - set(built_in)))
