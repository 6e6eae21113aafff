"""What a batching strategy is: its layout function and what ``plan validate`` expects of it.

Each strategy is one module defining ``STRATEGY = Strategy(...)``; nothing else names it, so
adding one is adding one file (docs/batching.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dflash.batching.layout import BatchLayout
from dflash.batching.params import PlanParams

LayoutFunction = Callable[[np.ndarray, PlanParams, np.random.Generator], BatchLayout]
"""``layout(sizes, params, rng)``: sample lengths, plan params, the epoch's generator."""


@dataclass(frozen=True)
class Strategy:
    name: str
    """What ``batching.strategy`` says; the module's own name."""
    layout: LayoutFunction
    """Where samples sit: a pure function of its arguments, so plans are reproducible."""
    doc: str
    """One line for ``--help``, the config docs and ``dflash report``."""
    frozen: bool = False
    """Its micro-batches are the same every epoch (only their order changes): validated."""
    packs_rows: bool = False
    """A row may hold several samples; otherwise validation requires one sample per row."""
    uses_buckets: bool = False
    """It needs ``boundaries`` (the planner resolves them) and no micro-batch mixes buckets."""
