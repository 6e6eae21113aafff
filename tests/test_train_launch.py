"""The train launcher: checks once before any rank starts, one writer, no orphan ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from conftest import survivors

from dflash.cli import run_stage
from dflash.config.params import load_config
from dflash.errors import ConfigError
from dflash.pipeline.lock import WorkspaceBusy, workspace_lock
from dflash.pipeline.workspace import Workspace
from dflash.train import preflight
from dflash.train.distributed.allocator import configure_allocator
from dflash.train.distributed.process_group import init_distributed

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def dflash_train(workspace: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [f"--set={o}" for o in overrides]
    cmd = [sys.executable, "-m", "dflash.cli", "train", *sets]
    return subprocess.run(cmd, cwd=workspace, env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("batching.token_budget=999", "token_budget: plan has 384, this run needs 999"),
        ("train.world_size=64", "world_size: plan has 2, this run needs 64"),
    ],
)
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_a_stale_plan_is_refused_once_before_torchrun_starts(
    tiny_workspace, override, problem, recorded
):
    """Recorded, the plan's provenance names the param; without a record (plans copied in),
    the plan's own summary still refuses it."""
    if not recorded:
        shutil.rmtree(tiny_workspace / WS.provenance)
    proc = dflash_train(tiny_workspace, override)
    assert proc.returncode == 2, proc.stderr
    key, value = override.split("=")
    if recorded:
        assert proc.stderr.count("stale input: data/plans was made with") == 1
        assert f"{key} = {value}" in proc.stderr
    else:
        assert proc.stderr.count("stale plan") == 1 and problem in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "torch.distributed" not in proc.stderr + proc.stdout
    assert not (tiny_workspace / WS.drafter).exists()


def test_more_ranks_than_gpus_is_an_error_and_than_cores_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    preflight.check_capacity(1)
    with pytest.raises(ConfigError, match="train.world_size = 2 but 1 GPU"):
        preflight.check_capacity(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    preflight.check_capacity(2)
    assert capsys.readouterr().err == ""
    preflight.check_capacity(8, "train.world_size + train.target_ranks")
    assert "train.world_size + train.target_ranks = 8 ranks on 2 CPU core(s)" in (
        capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match="= 9 ranks, but this machine runs at most 8"):
        preflight.check_capacity(9)


def test_impossible_rank_counts_exit_2_before_torchrun_starts(tiny_workspace):
    """More ranks than the machine runs are refused with the limit, before any process starts
    (a million is refused as a param: at most 65,536)."""
    proc = dflash_train(tiny_workspace, "train.topology=decoupled", "train.target_ranks=65000")
    assert proc.returncode == 2, proc.stderr
    assert "train.world_size + train.target_ranks = 65002 ranks" in proc.stderr
    assert "at most" in proc.stderr and "Traceback" not in proc.stderr
    assert "torch.distributed" not in proc.stderr + proc.stdout


def test_more_target_copies_than_memory_holds_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "weights_bytes", lambda directory: 4096)
    monkeypatch.setattr(os, "sysconf", lambda name: 1024 if name == "SC_PHYS_PAGES" else 8)
    preflight.check_memory(2, "train.world_size", tmp_path)
    with pytest.raises(ConfigError, match="at most 2 ranks fit"):
        preflight.check_memory(3, "train.world_size", tmp_path)


def test_a_second_train_in_the_workspace_exits_2_naming_the_holder(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    with workspace_lock(WS.lock, "evaluate"):
        proc = dflash_train(tiny_workspace)
    assert proc.returncode == 2, proc.stderr
    assert f"`dflash evaluate` (PID {os.getpid()})" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tiny_workspace / WS.drafter).exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    lock = tmp_path / "train.lock"
    dead = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"])
    dead.wait()
    lock.write_text(f"{dead.pid} train\n")
    with workspace_lock(lock, "plan"):
        assert lock.read_text() == f"{os.getpid()} plan\n"
        busy = pytest.raises(WorkspaceBusy, match=f"`dflash plan` \\(PID {os.getpid()}\\)")
        with busy, workspace_lock(lock, "train"):
            pass


@pytest.mark.slow
def test_kill_9_of_the_launchers_group_leaves_no_rank_alive(tiny_workspace, hold):
    """Killed while the ranks hold after their first checkpoint (tests/hold.py): mid-run."""
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--set=train.checkpoint_every=1"]
    launcher = subprocess.Popen(
        cmd,
        cwd=tiny_workspace,
        env=hold.env(1, ENV),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    hold.wait(launcher)
    tree = psutil.Process(launcher.pid).children(recursive=True)
    ranks = [p for p in tree if "dflash.train.distributed.agent" not in " ".join(p.cmdline())]
    assert len(ranks) == 2 and len(tree) == 3  # the torchrun agent and its two ranks
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    left = [p.pid for p in survivors(tree, timeout=10)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert not (tiny_workspace / WS.drafter).exists()


@pytest.mark.slow
def test_two_ranks_started_from_python_train_the_workspace_passed_in(
    tiny_workspace, tmp_path, monkeypatch
):
    """``run_stage("train", config, Workspace(root))`` called from another directory: the
    ranks read and write ``root``, as one process does, and the working directory gets
    nothing."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = load_config(tiny_workspace / "params.yaml", ["train.max_steps=2"])
    assert run_stage("train", config, Workspace(tiny_workspace)) == 0
    details = json.loads((tiny_workspace / WS.train_details).read_text())
    assert details["world_size"] == 2 and details["steps"] == 2
    assert (tiny_workspace / WS.drafter / "model.safetensors").is_file()
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, None),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, None),
    ],
)
def test_expandable_segments_unless_the_user_set_the_allocator(environ, expected):
    before = dict(environ)
    configure_allocator(environ)
    assert environ == (before if expected is None else expected)


def test_ranks_start_with_expandable_segments(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    init_distributed()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
