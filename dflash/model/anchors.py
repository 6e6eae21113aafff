"""Anchor sampling: where the training blocks of one document start.

DFlash trains on random anchors, re-drawn every epoch, rather than on a fixed tiling of the
sequence: the drafter then sees every position as a block start over training. An anchor must be
a token the loss covers and leave room for a whole block inside the document.
"""

from __future__ import annotations

import numpy as np


def sample_anchors(
    loss_mask: np.ndarray, block_size: int, count: int, rng: np.random.Generator
) -> np.ndarray:
    """Sorted anchor positions of ONE document, ``min(count, available)`` without replacement.

    Candidates are positions ``p`` with ``loss_mask[p] == 1`` and ``p <= len - block_size``.
    Sorting keeps blocks in sequence order, which makes the block mask more block-sparse.
    """
    loss_mask = np.asarray(loss_mask)
    if loss_mask.ndim != 1:
        raise ValueError(f"loss_mask must be 1-D (one document), got shape {loss_mask.shape}")
    if block_size < 1 or count < 0:
        raise ValueError(f"block_size = {block_size} must be >= 1 and count = {count} >= 0")
    last = len(loss_mask) - block_size
    candidates = np.flatnonzero(loss_mask[: max(last + 1, 0)] != 0)
    chosen = rng.choice(candidates, size=min(count, len(candidates)), replace=False)
    return np.sort(chosen).astype(np.int64)
