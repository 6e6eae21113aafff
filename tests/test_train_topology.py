"""Decoupled training: target ranks feed drafter ranks the features colocated ranks compute."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import gloo_rank, leave_gloo, run_stages, spawn_ranks, tiny_qwen3
from run_outputs import assert_same_drafter, losses

from dflash.batching.io import read_rank_plan
from dflash.config.schema import TrainConfig
from dflash.data.store import TokenStore
from dflash.features.prefetch import epoch_micro_batches
from dflash.features.sources.decoupled import place
from dflash.features.target_forward import target_features
from dflash.features.target_ranks import padding_forward, schedule
from dflash.model.load import load_target
from dflash.pipeline.workspace import Workspace
from dflash.train.batches import build_micro_batch, micro_batch_shape
from dflash.train.borrowed import load_borrowed
from dflash.train.distributed.parallel import load_sharded_target
from dflash.train.distributed.ranks import RankLayout, processes

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
DECOUPLED = ("train.topology=decoupled", "train.target_ranks=2")
SHARDED = (*DECOUPLED, "train.parallelism=fsdp")
"""Two target ranks holding FSDP shards of the target (and the drafter rank under FSDP)."""


def test_the_job_has_the_drafter_ranks_of_the_plan_plus_the_target_ranks():
    assert processes(TrainConfig(world_size=2)) == 2
    assert processes(TrainConfig(world_size=2, topology="decoupled", target_ranks=3)) == 5
    layout = RankLayout(drafter_ranks=2, target_ranks=3)
    assert [layout.role(r) for r in range(5)] == ["drafter"] * 2 + ["target"] * 3
    assert layout.roles() == "ranks 0-1 train the drafter, ranks 2-4 run the target"


def fake_steps(n_steps: int, per_step: int, seed: int) -> list:
    return [
        [[[(seed * 1000 + s * 10 + m, 0, 5 + m)]] for m in range(per_step)] for s in range(n_steps)
    ]


@pytest.mark.parametrize(("drafters", "targets", "first_step"), [(1, 2, 0), (3, 2, 2), (2, 3, 1)])
def test_every_micro_batch_is_computed_once_in_the_order_its_drafter_rank_takes_it(
    drafters, targets, first_step
):
    layout = RankLayout(drafters, targets)
    rank_steps = [fake_steps(5, 2, seed) for seed in range(drafters)]
    served = {
        t: schedule(layout, t, rank_steps, first_step) for t in range(drafters, drafters + targets)
    }
    for drafter, steps in enumerate(rank_steps):
        wanted = list(epoch_micro_batches(steps, first_step))
        got = sorted(
            (index, t, rows)
            for t, work in served.items()
            for d, index, rows in work
            if d == drafter  # noqa: E501
        )
        assert [(i, rows) for i, _, rows in got] == wanted
        assert all(t == layout.source(drafter, i) for i, t, _ in got)
    for work in served.values():
        assert work == sorted(work, key=lambda w: (w[1], w[0])), "sent out of consumption order"
    loads = [len(work) for work in served.values()]
    assert max(loads) - min(loads) <= 1


@pytest.mark.parametrize(
    ("drafters", "targets", "first_step"), [(1, 2, 0), (1, 2, 1), (1, 3, 1), (3, 2, 2), (2, 3, 1)]
)
def test_sharded_target_ranks_run_one_forward_each_per_round(drafters, targets, first_step):
    """Rounds of consecutive micro-batches in consumption order, padded at the ends only."""
    layout = RankLayout(drafters, targets, sharded_target=True)
    rank_steps = [fake_steps(5, 3, seed) for seed in range(drafters)]
    ranks = range(drafters, drafters + targets)
    rounds = {t: schedule(layout, t, rank_steps, first_step) for t in ranks}
    assert len({len(work) for work in rounds.values()}) == 1, "not in lockstep"
    whole = RankLayout(drafters, targets)
    for t in ranks:
        assert [w for w in rounds[t] if w is not None] == schedule(whole, t, rank_steps, first_step)
    served = [
        w for one_round in zip(*rounds.values(), strict=True) for w in one_round if w is not None
    ]
    consumed = sorted(
        (index, drafter, rows)
        for drafter, steps in enumerate(rank_steps)
        for index, rows in epoch_micro_batches(steps, first_step)
    )
    assert served == [(drafter, index, rows) for index, drafter, rows in consumed]
    n_rounds = len(rounds[drafters])
    padded = {k for work in rounds.values() for k, w in enumerate(work) if w is None}
    assert padded <= {0, n_rounds - 1}


def test_micro_batch_shape_is_the_one_built_from_the_rows(tiny_workspace):
    store = TokenStore(tiny_workspace / WS.tokenized)
    steps = read_rank_plan(tiny_workspace / "data/plans/epoch_000.parquet", 1)
    for _, rows in list(epoch_micro_batches(steps, 0))[:5]:
        mb = build_micro_batch(
            store, rows, block_size=4, anchors_per_sequence=6, gamma=7.0, seed=0, epoch=0
        )
        assert micro_batch_shape(rows) == tuple(mb.input_ids.shape)


def test_a_drafter_rank_holds_only_the_borrowed_embedding_and_head(tiny_workspace):
    whole = load_target(tiny_workspace / WS.target, device="cpu")
    borrowed = load_borrowed(tiny_workspace / WS.target, torch.device("cpu"), torch.float32)
    embed, head = borrowed.get_input_embeddings(), borrowed.get_output_embeddings()
    assert torch.equal(embed.weight, whole.get_input_embeddings().weight)
    assert torch.equal(head.weight, whole.get_output_embeddings().weight)
    real = {n for n, p in borrowed.named_parameters() if not p.is_meta}
    assert real == {"model.embed_tokens.weight"} | (
        set() if head.weight is embed.weight else {"lm_head.weight"}
    )
    assert borrowed.config.num_hidden_layers == whole.config.num_hidden_layers


def one_drafter_rank(workspace: Path) -> None:
    """Plans for one drafter rank and one epoch, logging every step."""
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["train"] |= {"world_size": 1, "epochs": 1, "checkpoint_every": 1}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params))
    run_stages(workspace, ["plan"])


def dflash_train(workspace: Path, *overrides: str, env=ENV, **kwargs) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash.cli", "train", *(f"--set={o}" for o in overrides)]
    return subprocess.Popen(
        cmd,
        cwd=workspace,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def finished(workspace: Path, *overrides: str) -> str:
    proc = dflash_train(workspace, *overrides)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def planned_once(tiny_workspace_template, tmp_path_factory) -> tuple[Path, Path]:
    """The colocated run on one rank (in this process, as ``dflash train`` runs one rank),
    and a copy of its workspace before it trained: made once for the module, since the tests
    only read the colocated run."""
    root = tmp_path_factory.mktemp("planned")
    colocated, fresh = root / "colocated", root / "decoupled"
    shutil.copytree(tiny_workspace_template, colocated)
    one_drafter_rank(colocated)
    shutil.copytree(colocated, fresh)
    run_stages(colocated, ["train"])
    return colocated, fresh


@pytest.fixture
def planned(planned_once, tmp_path) -> tuple[Path, Path]:
    """The shared colocated run (read only), and a private copy of the untrained workspace."""
    colocated, untrained = planned_once
    fresh = tmp_path / "decoupled"
    shutil.copytree(untrained, fresh)
    return colocated, fresh


@pytest.mark.slow
def test_a_decoupled_pilot_stops_its_target_ranks_with_its_drafter_ranks(planned):
    """Target ranks serve only the pilot's micro-batches: a send too many would never end."""
    colocated, decoupled = planned
    finished(decoupled, *DECOUPLED, "train.max_steps=2")
    assert losses(decoupled) == pytest.approx(losses(colocated)[:2], abs=1e-6, rel=0)
    assert json.loads((decoupled / WS.train_details).read_text())["steps"] == 2


@pytest.mark.slow
def test_fsdp_drafter_ranks_fed_by_a_target_rank_train_the_colocated_fsdp_drafter(
    tiny_workspace, trained
):
    """One target rank feeding 2 FSDP drafter ranks (the drafter sharded over the drafter
    ranks' own group) trains what colocated FSDP over 2 ranks does."""
    colocated = trained("train.parallelism=fsdp")
    finished(tiny_workspace, "train.parallelism=fsdp", "train.topology=decoupled",
             "train.target_ranks=1")  # fmt: skip
    assert len(losses(tiny_workspace)) > 1
    assert_same_drafter(colocated, tiny_workspace)
    assert json.loads((tiny_workspace / WS.train_details).read_text())["world_size"] == 2


def shard_on_three_ranks(rank: int, world_size: int, port: int, results, directory: str) -> None:
    """One of 1 drafter + 2 sharded target ranks: the target's shards, and its features with
    one target rank running a micro-batch while the other runs a padding forward."""
    world = gloo_rank(rank, world_size, port)
    train = TrainConfig(world_size=1, topology="decoupled", target_ranks=2, parallelism="fsdp")
    placement = place(train, world)
    result = {"rank": rank, "group": placement.ctx.world_size}
    if placement.serve is not None:
        target = load_sharded_target(directory, placement.ctx)
        result["held"] = sum(p.to_local().numel() for p in target.parameters())
        ids = torch.arange(24).view(2, 12) * 7 % 300
        documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [-1] * 3])
        positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
        expected = target_features(load_target(directory, "cpu"), ids, positions, documents, [1, 3])
        got = []
        for turn in (1, 2):
            with torch.inference_mode():
                if rank == turn:
                    got.append(target_features(target, ids, positions, documents, [1, 3]))
                else:
                    padding_forward(target, [1, 3], world.device)
        result["equal"] = torch.equal(got[0], expected)
    results.put(result)
    leave_gloo()


@pytest.mark.slow
def test_sharded_target_ranks_hold_half_the_target_and_pad_each_others_rounds(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path)
    ranks = spawn_ranks(shard_on_three_ranks, 3, str(tmp_path))
    assert [r["group"] for r in ranks] == [1, 2, 2]
    assert all(r["equal"] for r in ranks[1:])
    total = sum(p.numel() for p in model.parameters())
    assert sum(r["held"] for r in ranks[1:]) == total
    assert max(r["held"] for r in ranks[1:]) <= total // 2 + 300 * 32  # a row per tensor at most


def rank_process(job: subprocess.Popen, rank: int, deadline: float) -> psutil.Process:
    """The process of global ``rank`` in ``job`` (a rank, not torchrun's agent), once started."""
    while time.time() < deadline and job.poll() is None:
        for child in psutil.Process(job.pid).children(recursive=True):
            try:
                env, cmdline = child.environ(), " ".join(child.cmdline())
            except psutil.Error:
                continue
            if env.get("RANK") == str(rank) and "torch.distributed.run" not in cmdline:
                return child
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never started")


def assert_dies_naming(job: subprocess.Popen, victim: psutil.Process, rank: int, role: str, ws):
    """SIGKILL ``victim``: the job ends, naming its rank and role, and exports nothing (the
    other ranks wait on the dead one at most until torchrun stops them; the timeout is a hang
    guard)."""
    victim.send_signal(signal.SIGKILL)
    out, _ = job.communicate(timeout=300)
    assert job.returncode != 0
    named = re.search(rf"rank\s*:\s*{rank}\b", out) or f"rank {rank} ({role})" in out
    assert named, out[-3000:]
    assert "ranks 0-0 train the drafter, ranks 1-2 run the target" in out
    assert not (ws / WS.drafter).exists()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [DECOUPLED, SHARDED], ids=["whole", "sharded"])
def test_a_dead_target_rank_ends_the_job_and_the_rerun_trains_the_colocated_drafter(
    planned, hold, overrides
):
    """A target rank killed while the drafter rank holds after checkpoint 3 ends the job
    naming it; the rerun resumes at step 3, logs the colocated losses and exports its drafter
    (sharded, a resume between two rounds starts with a padded one)."""
    colocated, decoupled = planned
    job = dflash_train(decoupled, *overrides, env=hold.env(3, ENV))
    victim = rank_process(job, 2, time.time() + 300)
    hold.wait(job)
    assert_dies_naming(job, victim, 2, "target", decoupled)
    assert "(global step 3)" in finished(decoupled, *overrides).partition("resumed at")[2]
    assert_same_drafter(colocated, decoupled)
    details = json.loads((decoupled / WS.train_details).read_text())
    reference = json.loads((colocated / WS.train_details).read_text())
    assert details["final_simulated_tau"] == pytest.approx(reference["final_simulated_tau"])
    assert details["world_size"] == 1
    for key in ("target_idle_fraction", "drafter_wait_fraction"):
        assert 0.0 <= details[key] <= 1.0 and reference[key] == 0.0


@pytest.mark.slow
def test_a_dead_drafter_rank_ends_the_job_naming_its_rank_and_role(planned, hold):
    """Killed inside the run, held after its first step's checkpoint: models loaded and
    features flowing."""
    _, decoupled = planned
    job = dflash_train(decoupled, *DECOUPLED, env=hold.env(1, ENV))
    victim = rank_process(job, 0, time.time() + 300)
    hold.wait(job)
    assert_dies_naming(job, victim, 0, "drafter", decoupled)


def test_the_balancing_split_and_the_memory_per_role(monkeypatch):
    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    from gpu_memory import BF16, QWEN3_8B
    from memory_model import Batch, components, role_components
    from topology import best_split

    assert best_split(8, 1.0, 7.0)[0] == 1 and best_split(8, 1.0, 1.0)[0] == 4
    assert best_split(8, 3.0, 1.0)[0] == 6
    batch = Batch(rows=2, row_len=4096, anchors=1024)
    whole = components(QWEN3_8B, batch, BF16, BF16)
    target = role_components(QWEN3_8B, batch, BF16, BF16, "target")
    drafter = role_components(QWEN3_8B, batch, BF16, BF16, "drafter")
    assert target["target weights"] == whole["target weights"]
    halves = role_components(QWEN3_8B, batch, BF16, BF16, "target", shards=2)
    assert halves["target weights"] == whole["target weights"] / 2
    assert 0 < halves["gathered units (FSDP)"] < halves["target weights"] / 4
    assert "target weights" not in drafter
    assert sum(drafter.values()) < sum(whole.values()) - whole["target weights"] / 2
