"""Training stage: plan-driven micro-batches, global loss normalisation, exact resume."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_stages
from hold import Hold, held
from run_outputs import final_weights

from dflash.batching.errors import InvalidPlanError
from dflash.batching.io import read_plan_meta, read_rank_plan
from dflash.config.params import load_config
from dflash.data.store import TokenStore
from dflash.model.drafter import DFlashDrafter
from dflash.model.load import load_target
from dflash.pipeline.freshness import stale_drafter
from dflash.train.batches import build_micro_batch
from dflash.train.plan_check import check_plan
from dflash.train.step import micro_batch_loss

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(workspace: Path, *overrides: str, env=ENV, **kwargs) -> subprocess.Popen:
    args = [f"--set={o}" for o in overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(Path(__file__).resolve().parents[1] / "stages" / "train.py"), *args]
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


def kill_tree(pid: int) -> None:
    """SIGKILL the torchrun agent and its workers at once, like a crashed machine."""
    parent = psutil.Process(pid)
    for process in [parent, *parent.children(recursive=True)]:
        process.send_signal(signal.SIGKILL)


def test_micro_batch_weight_sum_matches_objective(tiny_workspace, monkeypatch):
    config = load_config(tiny_workspace / "params.yaml")
    monkeypatch.chdir(tiny_workspace)
    store = TokenStore("data/tokenized")
    steps = read_rank_plan(Path("data/plans/epoch_000.parquet"), 0)
    target = load_target(Path("models/target"))
    drafter = DFlashDrafter.from_target(
        target, block_size=4, num_hidden_layers=1, num_target_features=2, mask_token_id=3
    )
    d = config.drafter
    mb = build_micro_batch(
        store,
        steps[0][0],
        block_size=d.block_size,
        anchors_per_sequence=d.anchors_per_sequence,
        gamma=d.gamma,
        seed=0,
        epoch=0,
    )
    assert mb.real_tokens == sum(length for row in steps[0][0] for _, _, length in row)
    out = micro_batch_loss(target, drafter, drafter.config.target_layer_ids, mb, d.gamma)
    assert out.weight_sum.item() == pytest.approx(mb.weight_sum, rel=1e-6)


def test_anchors_redrawn_each_epoch_and_independent_of_rank(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    store = TokenStore("data/tokenized")
    row = [[(0, 0, int(store.lengths[0]))]]
    kw = dict(block_size=4, anchors_per_sequence=3, gamma=7.0, seed=0)
    a0 = build_micro_batch(store, row, epoch=0, **kw).anchors
    assert torch.equal(a0, build_micro_batch(store, row, epoch=0, **kw).anchors)
    draws = {
        tuple(build_micro_batch(store, row, epoch=e, **kw).anchors[0].tolist()) for e in range(6)
    }
    assert len(draws) > 1


def test_stale_plan_is_refused_with_what_differs(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    store = TokenStore("data/tokenized")
    meta = read_plan_meta(Path("data/plans"))
    config = load_config("params.yaml", ["train.world_size=4", "batching.token_budget=999"])
    with pytest.raises(InvalidPlanError) as err:
        check_plan(meta, store, config, world_size=4, plans=Path("data/plans"))
    assert "world_size: plan has 2, this run needs 4" in str(err.value)
    assert "stale plan in data/plans" in str(err.value)
    assert "token_budget" in str(err.value)
    check_plan(meta, store, load_config("params.yaml"), world_size=2, plans=Path("data/plans"))


def test_single_process_run_writes_metrics_plots_and_drafter(tiny_workspace):
    run_stages(tiny_workspace, ["plan", "train"], ["train.world_size=1", "train.epochs=1"])
    headline = json.loads((tiny_workspace / "metrics/train.json").read_text())
    for key in ("final_loss", "tokens_per_s", "padded_tokens_per_s", "padding_efficiency", "steps"):
        assert key in headline
    metrics = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert headline.items() <= metrics.items()
    plan = json.loads((tiny_workspace / "data/plans/summary.json").read_text())
    assert metrics["steps"] == plan["n_steps"]
    assert metrics["padding_efficiency"] == pytest.approx(plan["padding_efficiency"], rel=1e-6)
    rows = list(csv.DictReader(open(tiny_workspace / "plots/train/log.csv")))
    assert len(rows) == metrics["steps"]
    # τ on the held-out batch at every log row, and its cost beside the step time.
    assert all(1.0 <= float(row["simulated_tau"]) <= 4.0 for row in rows)
    assert metrics["final_simulated_tau"] == pytest.approx(float(rows[-1]["simulated_tau"]))
    assert 0.0 < metrics["simulated_tau_cost"]
    config = json.loads((tiny_workspace / "models/drafter/config.json").read_text())
    assert config["block_size"] == 4 and "target_layer_ids" in config["dflash_config"]
    assert stale_drafter(tiny_workspace) is None and "drafter_sha256" in metrics
    assert config["dflash_config"]["mask_token"] == "<|MASK|>"
    assert config["dtype"] == "float32"  # export.dtype auto: the tiny target's config says fp32
    card = (tiny_workspace / "models/drafter/README.md").read_text()
    assert '"num_speculative_tokens": 3' in card and "final_loss" in card
    source = load_config(tiny_workspace / "params.yaml").data.source
    assert f"`{source}` (`data.source`)" in card and f"source: {source}" in card
    assert (tiny_workspace / "models/drafter/dflash.py").is_file()


def test_a_pilot_stops_at_max_steps_on_the_full_runs_schedule(tiny_workspace):
    sets = ["train.world_size=1", "train.epochs=2", "train.max_steps=3", "train.warmup_ratio=0"]
    run_stages(tiny_workspace, ["plan", "train"], sets)
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    plan = json.loads((tiny_workspace / "data/plans/summary.json").read_text())
    assert details["steps"] == 3 and details["planned_steps"] == plan["n_steps"] > 6
    assert details["projected_hours"] * 3600 > details["train_seconds"] > 0
    assert "loss_length_corr" in json.loads((tiny_workspace / "metrics/train.json").read_text())
    rows = list(csv.DictReader(open(tiny_workspace / "plots/train/log.csv")))
    # The full run's cosine: three steps in, the rate has barely left its peak of 3e-3.
    assert [int(r["step"]) for r in rows] == [1, 2, 3] and float(rows[-1]["lr"]) > 2.9e-3
    steps = list(csv.DictReader(open(tiny_workspace / "plots/train/steps.csv")))
    assert len(steps) == 3 and all(float(r["mean_sample_length"]) > 0 for r in steps)
    by_class = tiny_workspace / "dvclive/train/plots/metrics/train/loss_by_length"
    assert any(by_class.iterdir())
    assert (tiny_workspace / "models/drafter/model.safetensors").is_file()


def test_max_steps_zero_exports_the_drafter_as_initialised(tiny_workspace):
    from dflash.eval.evaluate import untrained_drafter

    run_stages(tiny_workspace, ["plan", "train"], ["train.world_size=1", "train.max_steps=0"])
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert details["steps"] == 0 and details["projected_hours"] is None
    assert details["final_loss"] is None  # no step: no loss, rather than a perfect one
    headline = json.loads((tiny_workspace / "metrics/train.json").read_text(), parse_constant=int)
    assert headline["null_reasons"] == {"final_loss": "no optimizer step ran (train.max_steps: 0)"}
    target = load_target(tiny_workspace / "models/target")
    exported = DFlashDrafter.from_pretrained(tiny_workspace / "models/drafter", target)
    initial = untrained_drafter(exported, target, seed=0).state_dict()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, initial[name], atol=0, rtol=0)


@pytest.mark.slow
def test_two_processes_match_one_process_on_the_first_step(tiny_workspace, trained):
    """Same micro-batches in step 0 (2 ranks × 1 vs 1 rank × 2 accumulated) → same loss."""
    two_ranks = trained()
    two = read_rank_plan(two_ranks / "data/plans/epoch_000.parquet", 0)[0]
    two += read_rank_plan(two_ranks / "data/plans/epoch_000.parquet", 1)[0]
    loss_two = float(next(csv.DictReader(open(two_ranks / "plots/train/log.csv")))["loss"])

    single = ["train.world_size=1", "train.grad_accum=2", "train.epochs=1", "train.max_steps=1"]
    run_stages(tiny_workspace, ["plan"], single)
    one = read_rank_plan(tiny_workspace / "data/plans/epoch_000.parquet", 0)[0]
    as_set = lambda mbs: sorted(sorted(s for row in mb for s, _, _ in row) for mb in mbs)  # noqa: E731
    assert as_set(one) == as_set(two), "planner placed different micro-batches in step 0"
    run_stages(tiny_workspace, ["train"], single)
    loss_one = float(next(csv.DictReader(open(tiny_workspace / "plots/train/log.csv")))["loss"])
    assert loss_one == pytest.approx(loss_two, rel=1e-5)


def test_a_held_save_returns_only_once_released(tmp_path, monkeypatch):
    """The kill tests' hold (tests/hold.py): the named step's save writes, says so and waits;
    the other steps' saves return."""
    hold = Hold(tmp_path / "hold")
    for name, value in hold.env(2, {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    saved = []
    save = held(lambda directory, step, parts: saved.append(step))
    save("checkpoints", 1, {})
    thread = threading.Thread(target=save, args=("checkpoints", 2, {}), daemon=True)
    thread.start()
    while not hold.reached() and thread.is_alive():
        time.sleep(0.01)
    assert saved == [1, 2] and thread.is_alive()
    hold.release()
    thread.join(timeout=60)
    assert not thread.is_alive()
    save("checkpoints", 2, {})  # released: the step passes at once


def assert_kill_and_resume_is_bitwise(workspace: Path, reference: Path, *knobs: str) -> None:
    """Train with ``knobs``, SIGKILL the run held after step 3's checkpoint and resume it: its
    final drafter must be bitwise the uninterrupted ``reference``'s."""
    hold = Hold(workspace.with_name(workspace.name + "-hold"))
    proc = torchrun(workspace, *knobs, env=hold.env(3, ENV))
    hold.wait(proc)
    kill_tree(proc.pid)
    out, _ = proc.communicate()
    assert not (workspace / "models/drafter").exists(), f"not killed mid-run:\n{out[-3000:]}"
    digests = (workspace / "checkpoints").glob("*/step_????????.sha256")
    assert max(int(p.name[5:13]) for p in digests) == 3

    proc = torchrun(workspace, *knobs)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    assert "(global step 3)" in out.partition("resumed at")[2], out[-3000:]
    a, b = final_weights(reference), final_weights(workspace)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallelism", "loader"),
    [((), ("train.num_workers=1", "train.prefetch=2")), (("train.parallelism=fsdp",), ())],
    ids=["ddp-data-workers", "fsdp-in-process-loader"],
)
def test_sigkill_mid_epoch_then_resume_gives_identical_weights(
    tiny_workspace, trained, parallelism, loader
):
    """DDP with a loader worker process, FSDP with the loader in the rank: both resume the
    data exactly. Checkpoints and loader placement leave the weights as they are, so the
    uninterrupted run of the same parallelism without them is the reference."""
    knobs = ("train.checkpoint_every=1", *parallelism, *loader)
    assert_kill_and_resume_is_bitwise(tiny_workspace, trained(*parallelism), *knobs)


@pytest.mark.slow
def test_data_worker_error_ends_the_run_naming_it(tiny_workspace):
    """A loader worker's error reaches its rank, which ends the job: no rank is left waiting
    on a collective (the timeout is a hang guard)."""
    plan = tiny_workspace / "data/plans/epoch_000.parquet"
    table = pq.read_table(plan)
    lengths = table.column("length").to_pylist()
    lengths[-1] += 1
    broken = table.set_column(table.schema.get_field_index("length"), "length", [lengths])
    pq.write_table(broken.replace_schema_metadata(table.schema.metadata), plan)
    proc = torchrun(tiny_workspace, "train.num_workers=1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "the plan was made from other tokenized data" in out


@pytest.mark.slow
def test_dflash_train_launches_torchrun_itself(trained):
    """``trained`` runs ``dflash train`` as a user would: one process, which starts the ranks."""
    metrics = json.loads((trained() / "metrics/train_details.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == metrics["planned_steps"]
