"""What a plan is made with, apart from the lengths: its own module, imported by the planner,
the strategies and the stats stage alike (so none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.batching.cost import BY_PADDED_TOKENS, CostModel


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
    cost: CostModel = BY_PADDED_TOKENS
    """How micro-batches are weighed when dealt to ranks (padded tokens alone by default)."""
