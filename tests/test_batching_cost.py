"""Ranks are dealt equal work, where work is the target's tokens plus the drafter's blocks."""

from __future__ import annotations

import numpy as np

from dflash.batching.cost import BY_PADDED_TOKENS, CostModel
from dflash.batching.metrics import epoch_metrics
from dflash.batching.params import PlanParams
from dflash.batching.planner import plan_epoch

COST = CostModel(anchors_per_document=512, block_size=16, slot_cost=0.5)


def longtail(n: int = 20_000) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(7.24, 0.9, n), 16, 8192).astype(np.int32)


def test_a_document_trains_at_most_its_room_for_blocks():
    model = CostModel(anchors_per_document=4, block_size=16, slot_cost=1.0)
    assert model.anchors(np.array([10, 16, 18, 100])).tolist() == [0, 0, 2, 4]
    padded = np.array([100, 50])
    costs = model.of(padded, np.array([18, 100, 100]), np.array([0, 2]))
    assert costs.tolist() == [100 + 16 * 6, 50 + 16 * 4]


def test_without_a_drafter_cost_the_plan_is_dealt_by_padded_tokens():
    lengths = longtail(4_000)
    params = PlanParams("packed", 16_384, 8192, 64, world_size=4, seed=3)
    free = PlanParams(**{**vars(params), "cost": CostModel(512, 16, 0.0)})
    assert plan_epoch(lengths, params, 0).equals(plan_epoch(lengths, free, 0))


def test_dealing_by_cost_balances_the_ranks_work():
    lengths = longtail()
    for strategy in ("sorted", "shuffle", "packed"):
        by_cost = PlanParams(strategy, 49_152, 8192, 64, world_size=8, cost=COST)
        by_tokens = PlanParams(**{**vars(by_cost), "cost": BY_PADDED_TOKENS})
        dealt = epoch_metrics(plan_epoch(lengths, by_cost, 0), lengths.size, None, COST)[0]
        naive = epoch_metrics(plan_epoch(lengths, by_tokens, 0), lengths.size, None, COST)[0]
        assert dealt["cost_imbalance"] <= 0.02 < naive["cost_imbalance"], strategy
        assert dealt["cost_imbalance"] < naive["cost_imbalance"] / 3
