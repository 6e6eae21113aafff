"""A train job's faults end in one line each: nodes that run other params or never meet, a rank
that fails; and loader workers cannot hang as they start."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import pytest
from torch.distributed import run

from dflash.commands import exits
from dflash.config.schema import Config, TrainConfig
from dflash.errors import UserError
from dflash.pipeline.lock import FAILURE_LOG
from dflash.pipeline.workspace import Workspace
from dflash.stages import train as train_stage
from dflash.train.batches import make_loader
from dflash.train.distributed.agent import meet
from dflash.train.distributed.node_checks import differences, shared_params
from dflash.train.distributed.nodes import Nodes, torchrun_args

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LOG = Workspace().train_failures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int | None = None, count: int = 2) -> Namespace:
    """torchrun's options as the launcher gives them to node ``rank`` of ``count``."""
    nodes = Nodes(count, rank, f"127.0.0.1:{port}")
    return run.parse_args([*torchrun_args(nodes, processes=count), "-m", "dflash.cli"])


def _train(workspace: Path, *args: str) -> subprocess.Popen:
    """``dflash train`` in ``workspace``, its output to a file (a pipe could fill and block it)."""
    cmd = [sys.executable, "-m", "dflash.cli", "train", *args]
    with workspace.with_suffix(".log").open("w") as out:
        return subprocess.Popen(cmd, cwd=workspace, env=ENV, stdout=out, stderr=subprocess.STDOUT)


def _ended(job: subprocess.Popen, workspace: Path) -> tuple[int, str]:
    job.wait(180)
    return job.returncode, workspace.with_suffix(".log").read_text()


def test_a_node_param_that_differs_is_named_with_both_values_unless_it_is_the_nodes_own():
    head = {"train": {"lr": 0.003, "max_steps": None, "num_workers": 1}, "engine": {"model": "a"}}
    node = {"train": {"lr": 0.1, "max_steps": 5, "num_workers": 4}, "engine": {"model": "a"}}
    node["engine"]["endpoints"] = ["http://node1:8000/v1"]  # each node asks its own engines
    assert differences(shared_params(head), shared_params(node)) == [
        "train.lr = 0.1 (head: 0.003)",
        "train.max_steps = 5 (head: null)",
    ]


@pytest.mark.slow
def test_a_worker_with_other_params_stops_every_node_in_one_line(tiny_workspace_template, tmp_path):
    """Before: the worker trained with train.lr 0.1 while the head recorded 0.003. Each node
    prints the params line and its failed rank's line; torchrun's report is in the log."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for workspace in nodes:
        shutil.copytree(tiny_workspace_template, workspace)
    common = ["--set=train.world_size=2", f"--set=train.checkpoint_dir={tmp_path / 'shared'}"]
    common += ["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]
    worker = ["--set=train.lr=0.1", "--set=train.num_workers=0"]  # num_workers: its own
    jobs = [
        _train(nodes[0], *common, "--node-rank=0"),
        _train(nodes[1], *common, *worker, "--node-rank=1"),
    ]
    results = [_ended(job, ws) for job, ws in zip(jobs, nodes, strict=True)]
    assert [rc for rc, _ in results] == [2, 2], results
    for (_, out), workspace in zip(results, nodes, strict=True):
        assert "node 1 runs other params than the head: train.lr = 0.1 (head: 0.003);" in out
        assert f"exited 2; torchrun's report: {LOG}" in out, out
        assert "Traceback" not in out and "FAILED" not in out, out
        assert not re.search(r"^[EWI]\d{4} ", out, re.MULTILINE), out  # torch's log records
        assert "dflash.cli FAILED" in (workspace / LOG).read_text()
    assert not (nodes[0] / "models/drafter/model.safetensors").exists()


def test_one_node_meets_no_one():
    assert meet(_node(0, count=1), 0.5) is None


def test_the_head_names_the_node_that_never_joins():
    with pytest.raises(UserError, match=r"node 1 of 2 did not join at --rdzv-endpoint .* 0.5 s"):
        meet(_node(0, _free_port()), 0.5)


def test_nodes_that_start_meet():
    port, met = _free_port(), []
    worker = threading.Thread(target=lambda: met.append(meet(_node(1, port), 10)))
    worker.start()  # it retries until the head's server listens
    head = meet(_node(0, port), 10)
    worker.join(10)
    assert head is not None and len(met) == 1


def test_a_port_another_program_holds_ends_either_node_in_one_line():
    """Before: the head's torchrun died with DistNetworkError's traceback (EADDRINUSE); the
    worker, answered by that program, waited forever."""
    before = set(threading.enumerate())
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(UserError, match=f"another program on the head holds port {port}"):
            meet(_node(0, port), 0.5)
        with pytest.raises(UserError, match="node 1 reached no head at .* within 0.5 s"):
            meet(_node(1, port), 0.5)
    for left in set(threading.enumerate()) - before:  # the worker's store client: the closed
        left.join(10)  # port resets it, and torch's warning lands in this test's output


@pytest.mark.slow
def test_a_head_whose_worker_never_starts_exits_2_in_one_line(tiny_workspace):
    """Before: the head waited ~905 s, then printed torch's DistStoreError traceback."""
    sets = ["--set=train.rendezvous_timeout_s=1", "--nnodes=2", "--node-rank=0"]
    job = _train(tiny_workspace, *sets, f"--rdzv-endpoint=127.0.0.1:{_free_port()}")
    rc, out = _ended(job, tiny_workspace)
    assert rc == 2, out
    assert out.splitlines()[-1].startswith("dflash train: node 1 of 2 did not join"), out
    assert "Traceback" not in out


def test_a_rank_that_crashes_prints_one_line_and_logs_its_traceback(tmp_path, monkeypatch, capsys):
    log = tmp_path / "failures.log"
    monkeypatch.setenv(FAILURE_LOG, str(log))
    monkeypatch.setenv("RANK", "1")
    try:
        raise RuntimeError("NCCL error: unhandled system error\nmore detail")
    except RuntimeError as err:
        exits.report_crash("train", err)
    line = "dflash train: rank 1: RuntimeError: NCCL error: unhandled system error"
    assert capsys.readouterr().err == f"{line} (traceback: {log})\n"
    assert "Traceback (most recent call last)" in log.read_text()
    assert log.read_text().startswith("rank 1: ")


def test_loader_workers_are_spawned_not_forked_from_the_rank():
    """torch's worker loop calls torch.set_num_threads(1) first; forked from a rank whose
    threads held torch's thread-pool lock, the call waited forever. Spawned, a worker is still
    the rank's child and dies with it (a fork server's children outlived the rank)."""
    loader = make_loader([0, 1], num_workers=1, prefetch=1, pin_memory=False)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    in_process = make_loader([0, 1], num_workers=0, prefetch=1, pin_memory=False)
    assert in_process.multiprocessing_context is None


def test_a_spawned_loader_worker_imports_no_model_code():
    """A spawned worker imports what unpickling its batch builder needs; without the model
    stack (transformers) that is about half the CPU time a worker takes to start."""
    code = "import sys, dflash.train.batches; print(sorted({'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_decoupled_job_names_the_failed_ranks_role(tmp_path, capsys):
    config = Config(train=TrainConfig(topology="decoupled", world_size=1, target_ranks=2))
    assert train_stage._outcome(config, Workspace(tmp_path), 1, failed=2) == 1
    assert capsys.readouterr().err == (
        "dflash train: rank 2 (target) failed; ranks 0-0 train the drafter, ranks 1-2 run the "
        "target\n"
    )
