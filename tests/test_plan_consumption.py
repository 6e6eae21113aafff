"""Each rank trains on exactly its plan rows, in plan order, each once per epoch.

The token store is replaced by one whose every token of sample ``i`` is ``i + 1``, so the
micro-batch tensors a rank's DataLoader yields show which samples they hold and where.
"""

from __future__ import annotations

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import torch

from dflash.batching.boundaries import optimal_boundaries
from dflash.batching.io import epoch_path, read_rank_plan
from dflash.batching.params import PlanParams
from dflash.batching.planner import write_plans
from dflash.train.batches import PlannedSteps, StepBuilder, StepDataset, make_loader

WORLD, ACCUM, EPOCHS = 2, 2, 2


class CodedStore:
    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        n = int(self.lengths[i])
        return np.full(n, i + 1, dtype=np.int64), np.ones(n, dtype=np.uint8)


def placements(step: int, micro_batches) -> list[tuple]:
    """(step, micro, row, offset, sample_id, length) of every document, read off the tensors."""
    found = []
    for micro, mb in enumerate(micro_batches):
        for row in range(mb.input_ids.shape[0]):
            docs = mb.document_ids[row]
            for doc in docs[docs >= 0].unique().tolist():
                where = (docs == doc).nonzero().flatten()
                tokens = mb.input_ids[row, where].unique().tolist()
                assert len(tokens) == 1, "a document holds tokens of two samples"
                offset, length = int(where[0]), int(where.numel())
                assert where.tolist() == list(range(offset, offset + length))
                found.append((step, micro, row, offset, tokens[0] - 1, length))
    return found


@pytest.mark.parametrize("strategy", ["sorted", "shuffle", "bucketed", "packed"])
def test_each_rank_consumes_exactly_its_plan_rows_in_order(tmp_path, strategy):
    """Through a rank's loader as training builds it: one loader for every epoch, its
    workers (packed: two) kept from one epoch to the next."""
    lengths = np.random.default_rng(1).integers(5, 40, 90).astype(np.int32)
    boundaries = tuple(optimal_boundaries(lengths, 3)) if strategy == "bucketed" else None
    params = PlanParams(strategy, 160, 48, 4, WORLD, ACCUM, seed=3, boundaries=boundaries)
    write_plans(lengths, params, EPOCHS, tmp_path)
    builder = StepBuilder(
        CodedStore(lengths), block_size=4, anchors_per_sequence=2, gamma=7.0, seed=0
    )
    columns = ["step", "micro", "row", "offset", "sample_id", "length"]
    plans = [pq.read_table(epoch_path(tmp_path, epoch)).to_pydict() for epoch in range(EPOCHS)]
    rows = [list(zip(p["rank"], *(p[c] for c in columns), strict=True)) for p in plans]
    consumed: list[list[int]] = [[] for _ in range(EPOCHS)]
    for rank in range(WORLD):
        planned = PlannedSteps()
        workers = 2 if strategy == "packed" else 0  # order must survive worker processes
        loader = make_loader(builder, workers, 2, False, sampler=planned)
        for epoch in range(EPOCHS):
            planned.set_epoch(epoch, read_rank_plan(epoch_path(tmp_path, epoch), rank), 0)
            got = []
            for step, micro_batches in enumerate(loader):
                assert len(micro_batches) == ACCUM
                got += placements(step, micro_batches)
            assert got == [row[1:] for row in rows[epoch] if row[0] == rank], (rank, epoch)
            consumed[epoch] += [sample for *_, sample, _ in got]
    for samples in consumed:
        assert sorted(samples) == list(range(len(lengths))), "each sample once per epoch"
    if strategy == "packed":
        for epoch_rows in rows:
            keys = [row[:4] for row in epoch_rows]
            assert len(set(keys)) < len(keys), "no packed row holds several documents"


def test_one_pool_of_workers_serves_every_epochs_plan_and_a_resume(tmp_path):
    """Persistent workers build exactly what a fresh per-epoch loader builds, epoch by epoch."""
    lengths = np.random.default_rng(2).integers(5, 40, 60).astype(np.int32)
    write_plans(lengths, PlanParams("shuffle", 160, 48, 4, WORLD, ACCUM, seed=3), EPOCHS, tmp_path)
    store = CodedStore(lengths)
    knobs = dict(block_size=4, anchors_per_sequence=2, gamma=7.0, seed=0)
    planned = PlannedSteps()
    loader = make_loader(StepBuilder(store, **knobs), 2, 2, False, sampler=planned)
    pools = []
    for epoch, first_step in [(0, 0), (1, 0), (1, 2)]:
        steps = read_rank_plan(epoch_path(tmp_path, epoch), 1)
        planned.set_epoch(epoch, steps, first_step)
        got = list(loader)
        pools.append(loader_workers())
        fresh = StepDataset(store, steps, first_step=first_step, epoch=epoch, **knobs)
        assert len(got) == len(fresh) == len(steps) - first_step
        for mine, theirs in zip(got, make_loader(fresh, 0, 2, False), strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))
                assert a.weight_sum == b.weight_sum and a.n_samples == b.n_samples
    assert len(pools[0]) == 2 and pools[0] == pools[1] == pools[2], "workers were started again"


def loader_workers() -> set[int]:
    """The loader's spawned workers among this process's children (not the resource tracker
    that spawning starts)."""
    children = psutil.Process().children()
    return {p.pid for p in children if "spawn_main" in " ".join(p.cmdline())}


def tensors(micro_batch) -> list[torch.Tensor]:
    return [v for v in vars(micro_batch).values() if isinstance(v, torch.Tensor)]
