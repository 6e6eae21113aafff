"""What a micro-batch costs a rank: the target's tokens plus the drafter's block slots.

The frozen target pays per token (padded). The drafter pays per block slot: each document
trains up to ``anchors_per_document`` blocks of ``block_size`` slots, forward and backward,
with the LM head over every slot's label. At the recipe's 512 anchors a micro-batch of many
short documents costs far more than one long document of the same tokens, so ranks dealt equal
tokens wait on each other. ``slot_cost`` is one slot's cost in target tokens
(``bench/step_time.py`` measures it on the run's shapes); 0 deals by padded tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    anchors_per_document: int
    block_size: int
    slot_cost: float
    """No default here: ``batching.slot_cost``'s (``dflash.config.schema``) is the one."""

    def anchors(self, lengths: np.ndarray) -> np.ndarray:
        """Blocks a document trains at most: its anchors need a whole block after them."""
        room = np.maximum(lengths.astype(np.int64) - self.block_size, 0)
        return np.minimum(room, self.anchors_per_document)

    def of(self, padded: np.ndarray, lengths: np.ndarray, mb_starts: np.ndarray) -> np.ndarray:
        """Cost per micro-batch, from its padded tokens and its documents' ``lengths`` in plan
        order (``mb_starts``: where each micro-batch's documents begin)."""
        if not (self.slot_cost and self.anchors_per_document and lengths.size):
            return padded.astype(np.float64)
        anchors = np.add.reduceat(self.anchors(lengths), mb_starts)
        return padded + self.slot_cost * self.block_size * anchors.astype(np.float64)


BY_PADDED_TOKENS = CostModel(anchors_per_document=0, block_size=0, slot_cost=0.0)
"""Deal by padded tokens alone: what the stats stage simulates, and a plan without a drafter."""
