"""Multi-process training pin: DDP with accumulation (no_sync) equals one process."""

from __future__ import annotations

import json

import pytest
from conftest import run_stages
from run_outputs import losses
from test_train import torchrun

from dflash.batching.io import read_rank_plan


def step_samples(workspace, world: int, step: int) -> list[list[int]]:
    """The sorted sample ids of each micro-batch of ``step``, over all ranks."""
    path = workspace / "data/plans/epoch_000.parquet"
    mbs = [mb for rank in range(world) for mb in read_rank_plan(path, rank)[step]]
    return sorted(sorted(s for row in mb for s, _, _ in row) for mb in mbs)


@pytest.mark.slow
def test_ddp_with_accumulation_matches_one_process(tiny_workspace):
    """2 ranks x 2 accumulated micro-batches (no_sync on the first) = 1 rank x 4, every step.

    The planner deals each step's micro-batches the same way for both splits, so every step
    sees the same samples; a micro-batch lost or counted twice on the no_sync path would
    change the gradient and every loss after the first step.
    """
    two = ["train.epochs=1", "train.grad_accum=2"]
    run_stages(tiny_workspace, ["plan"], two)
    n_steps = json.loads((tiny_workspace / "data/plans/summary.json").read_text())["n_steps"]
    planned_two = [step_samples(tiny_workspace, 2, s) for s in range(n_steps)]
    proc = torchrun(tiny_workspace, *two)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    ddp = losses(tiny_workspace)

    one = ["train.epochs=1", "train.world_size=1", "train.grad_accum=4"]
    run_stages(tiny_workspace, ["plan"], one)
    assert [step_samples(tiny_workspace, 1, s) for s in range(n_steps)] == planned_two
    run_stages(tiny_workspace, ["train"], one)
    single = losses(tiny_workspace)
    assert len(ddp) == len(single) == n_steps >= 2
    assert single == pytest.approx(ddp, rel=1e-4)
