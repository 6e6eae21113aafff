"""What a plan is made with, apart from the lengths: its own module, imported by the planner,
the strategies and the stats stage alike (so none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanParams:
    strategy: str
    token_budget: int
    max_seq_len: int
    max_batch_size: int
    world_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    boundaries: tuple[int, ...] | None = None
    """Resolved bucket edges; only ``bucketed`` uses them."""
