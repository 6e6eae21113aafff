"""Held-out drafter loss by sample length: does a batching strategy serve some lengths worse?

Length-sorted batches can make the loss spike at batch boundaries; a strategy may also leave
long or short samples undertrained. Each evaluation prompt with the target's own greedy answer
is one held-out sample; the DFlash objective is computed on it with a block anchored at every
answer position, and the loss is averaged per length tercile.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dflash.eval.strata import TERCILES, tercile_groups
from dflash.features.target_forward import target_features
from dflash.model.drafter import DFlashDrafter, drafter_autocast
from dflash.model.objective import dflash_objective


@torch.no_grad()
def sample_loss(
    target: nn.Module, drafter: DFlashDrafter, prompt: list[int], answer: list[int], gamma: float
) -> tuple[float, float]:
    """(Σ w·CE, Σ w) of blocks anchored at every answer token that has a label after it."""
    ids = torch.tensor([prompt + answer], device=target.device)
    T, start = ids.shape[1], len(prompt)
    anchors = torch.arange(start, T - 1, device=ids.device)[None]
    if anchors.numel() == 0:
        return 0.0, 0.0
    positions = torch.arange(T, device=ids.device)[None]
    documents = torch.zeros_like(ids)
    loss_mask = (positions >= start).long()
    features = target_features(target, ids, positions, documents, drafter.config.target_layer_ids)
    with drafter_autocast(ids.device):
        out = dflash_objective(
            drafter, features, ids, loss_mask, documents, positions, anchors, gamma
        )
    return float(out.loss_sum), float(out.weight_sum)


def loss_by_tercile(lengths: list[int], sums: list[tuple[float, float]]) -> dict:
    """Weighted loss overall and per length tercile, with the two tercile boundaries."""
    lengths_a = np.asarray(lengths)
    loss = np.array([s for s, _ in sums])
    weight = np.array([w for _, w in sums])
    if weight.sum() == 0:
        return {}
    group, edges = tercile_groups(lengths_a)
    by = {}
    for g, name in enumerate(TERCILES):
        w = weight[group == g].sum()
        by[name] = float(loss[group == g].sum() / w) if w > 0 else None
    return {
        "heldout_loss": float(loss.sum() / weight.sum()),
        "heldout_loss_by_length": by,
        "length_tercile_edges": [float(e) for e in edges],
    }
