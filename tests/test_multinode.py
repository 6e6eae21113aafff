"""Two nodes on one machine: two torchrun agents meeting at 127.0.0.1 over gloo, each node in
its own copy of the workspace, as on two machines that share only a checkpoint directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from argparse import ArgumentParser, Namespace
from pathlib import Path

import psutil
import pytest

from dflash.config.schema import TrainConfig
from dflash.errors import UserError
from dflash.train.distributed.nodes import (
    NODE_ENV,
    Nodes,
    add_arguments,
    nodes_of,
    torchrun_args,
    worker_command,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
WEIGHTS = "models/drafter/model.safetensors"
DETAILS = "metrics/train_details.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(workspace: Path, *args: str, env: dict[str, str] = ENV) -> subprocess.Popen:
    """Output to a file, not a pipe: a node blocked on a full pipe would hold the others at
    torchrun's exit barrier."""
    cmd = [sys.executable, "-m", "dflash.cli", "train", *args]
    log = workspace.with_name(workspace.name + ".log")
    with log.open("w") as f:
        job = subprocess.Popen(cmd, cwd=workspace, env=env, stdout=f, stderr=subprocess.STDOUT)
    job.log = log
    return job


def _output(job: subprocess.Popen, timeout: float = 120) -> str:
    try:
        job.wait(timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"no exit in {timeout} s; its output:\n{job.log.read_text()}")
    return job.log.read_text()


def _two_nodes(head: Path, worker: Path, *sets: str) -> list[tuple[int, str]]:
    """Run the job on two nodes of one rank each; each node's exit status and output."""
    common = [f"--set={s}" for s in ("train.world_size=2", *sets)]
    common += ["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]
    jobs = [_train(ws, *common, f"--node-rank={r}") for r, ws in enumerate((head, worker))]
    outs = [_output(job) for job in jobs]
    return [(job.returncode, out) for job, out in zip(jobs, outs, strict=True)]


def _rank(cmdline: list[str]) -> bool:
    return "dflash.cli" in cmdline and "dflash.train.distributed.agent" not in cmdline


def _weights(workspace: Path) -> bytes:
    return (workspace / WEIGHTS).read_bytes()


def _losses(workspace: Path) -> str:
    """Each step's loss beside its mean sample length."""
    return (workspace / "plots/train/steps.csv").read_text()


@pytest.fixture
def one_node(trained) -> Path:
    """The reference: the tiny workspace trained by one node of two ranks."""
    return trained()


def _copies(template: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    head, worker = tmp_path / "node0", tmp_path / "node1"
    for ws in (head, worker):
        shutil.copytree(template, ws)
    return head, worker, tmp_path / "shared-checkpoints"


@pytest.mark.slow
def test_two_nodes_of_one_rank_train_what_one_node_of_two_does(
    one_node, tiny_workspace_template, tmp_path
):
    head, worker, shared = _copies(tiny_workspace_template, tmp_path)
    (head_rc, out), (worker_rc, worker_out) = _two_nodes(
        head, worker, f"train.checkpoint_dir={shared}"
    )
    assert head_rc == 0 and worker_rc == 0, out + worker_out
    assert "--node-rank=1 --rdzv-endpoint=127.0.0.1:" in out  # the head says how workers join
    assert _weights(head) == _weights(one_node)
    assert _losses(head) == _losses(one_node)
    assert not (worker / WEIGHTS).exists()  # exports and metrics: the head's rank 0 only
    assert not (worker / DETAILS).exists()


@pytest.mark.slow
def test_a_node_with_another_token_store_stops_the_job_naming_it(tiny_workspace_template, tmp_path):
    head, worker, shared = _copies(tiny_workspace_template, tmp_path)
    (worker / "data/tokenized/stale-shard").write_bytes(b"\0")
    results = _two_nodes(head, worker, f"train.checkpoint_dir={shared}")
    assert [rc for rc, _ in results] == [2, 2], results  # the input refused, on every node
    out = "".join(o for _, o in results)
    assert "node 1's token store" in out and "differs from the head's" in out, out
    assert not (head / WEIGHTS).exists()
    assert not any(shared.glob("*/step-*"))  # before the first step


@pytest.mark.slow
def test_a_checkpoint_directory_not_shared_is_refused(tiny_workspace_template, tmp_path):
    head, worker, _ = _copies(tiny_workspace_template, tmp_path)
    results = _two_nodes(head, worker)  # checkpoints/ of each node's own copy
    assert [rc for rc, _ in results] == [2, 2], results
    out = "".join(o for _, o in results)
    assert "node(s) [1] do not see" in out and "set train.checkpoint_dir" in out, out
    assert not (head / WEIGHTS).exists()


@pytest.mark.slow
def test_a_killed_rank_restarts_from_its_checkpoint_to_the_same_drafter(
    one_node, tiny_workspace_template, tmp_path, hold
):
    """A rank killed while the ranks hold after checkpoint 2 (tests/hold.py): torchrun
    restarts them, and they resume at step 2 (the restarted ranks save step 2 no more)."""
    workspace = tmp_path / "ws"
    shutil.copytree(tiny_workspace_template, workspace)
    job = _train(workspace, "--set=train.max_restarts=1", env=hold.env(2, ENV))
    hold.wait(job)
    ranks = [p for p in psutil.Process(job.pid).children(recursive=True) if _rank(p.cmdline())]
    os.kill(max(p.pid for p in ranks), signal.SIGKILL)
    out = _output(job)
    assert job.returncode == 0, out
    assert "(global step 2)" in out.partition("resumed at")[2], out
    assert json.loads((workspace / DETAILS).read_text())["restarts"] == 1
    assert _weights(workspace) == _weights(one_node)


def test_the_node_count_must_divide_the_ranks_and_name_where_to_meet():
    train = TrainConfig(world_size=4)

    def nodes(count: int, rank: int = 0, endpoint: str | None = "head:29400") -> Nodes:
        return nodes_of(Namespace(nnodes=count, node_rank=rank, rdzv_endpoint=endpoint), 4, train)

    with pytest.raises(UserError, match="--nnodes 3 does not divide train.world_size = 4"):
        nodes(3)
    with pytest.raises(UserError, match="needs --rdzv-endpoint HOST:PORT"):
        nodes(2, endpoint=None)
    with pytest.raises(UserError, match=r"--node-rank must be in \[0, 2\)"):
        nodes(2, rank=2)
    two = nodes(2, rank=1)
    assert torchrun_args(two, 4) == [
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=static",
        "--rdzv-endpoint=head:29400",
        "--nproc-per-node=2",
    ]
    assert torchrun_args(Nodes(), 4) == ["--standalone", "--nproc-per-node=4"]
    options = Namespace(params="params.yaml", overrides=["train.lr=1e-3"])
    assert worker_command(two, options, 1) == (
        "dflash train --params params.yaml --set=train.lr=1e-3 --nnodes=2 --node-rank=1 "
        "--rdzv-endpoint=head:29400"
    )


def test_the_node_options_can_come_from_the_environment_as_under_dvc_repro(monkeypatch):
    for option, name in NODE_ENV.items():
        monkeypatch.setenv(name, {"nnodes": "2", "node_rank": "1"}.get(option, "head:29400"))
    parser = ArgumentParser()
    add_arguments(parser)
    options = parser.parse_args([])
    assert nodes_of(options, 2, TrainConfig(world_size=2)) == Nodes(2, 1, "head:29400")
    assert parser.parse_args(["--node-rank=0"]).node_rank == 0  # the command line wins
    monkeypatch.setenv(NODE_ENV["nnodes"], "two")
    parser = ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([])
    assert exit_.value.code == 2
