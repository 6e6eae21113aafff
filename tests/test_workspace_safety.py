"""A run never erases another run, a workspace has one writer, and stages refuse stale inputs."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import checkpoint_written, run_stages, survivors

from dflash import cli
from dflash.declaration import COMMANDS, stages
from dflash.fileio import SIGINT_EXIT
from dflash.lock import workspace_lock
from dflash.params import load_config
from dflash.provenance import StaleInput
from dflash.stages import plan as plan_stage
from dflash.stages import train as train_stage
from dflash.stages.train import fingerprint
from dflash.train import checkpoint
from dflash.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

ONE_PROCESS = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=2"]
PARAMS = "data:\n  source: chitchat\n"
"""A valid params file: every other param takes its default."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def runs(workspace: Path) -> list[Path]:
    return checkpoint.run_directories(workspace / WS.checkpoints)


def test_a_run_with_other_params_keeps_the_first_runs_checkpoints(tiny_workspace, capsys):
    """Going back to the first params resumes its checkpoints, however many runs came between."""
    run_stages(tiny_workspace, ["plan", "train"], ONE_PROCESS)
    (first,) = runs(tiny_workspace)
    steps = checkpoint.list_checkpoints(first)
    assert steps

    run_stages(tiny_workspace, ["train"], [*ONE_PROCESS, "train.lr=1e-3"])
    assert "resumed" not in capsys.readouterr().out
    assert len(runs(tiny_workspace)) == 2
    assert checkpoint.list_checkpoints(first) == steps, "another run's checkpoints were touched"

    run_stages(tiny_workspace, ["train"], ONE_PROCESS)
    assert "resumed at epoch 1" in capsys.readouterr().out


def test_runs_past_keep_runs_are_pruned_least_recently_written_first(tmp_path):
    root = tmp_path / "checkpoints"
    for i, name in enumerate(["a" * 16, "b" * 16, "c" * 16]):
        (root / name).mkdir(parents=True)
        (root / name / "step_00000001.sha256").write_text("x")
        os.utime(root / name / "step_00000001.sha256", (1000 + i, 1000 + i))
    (root / "not-a-run").mkdir()
    current = root / ("a" * 16)  # the oldest, but the one starting now: never pruned
    removed = checkpoint.prune_runs(root, 2, current)
    assert removed == [root / ("b" * 16)]
    assert sorted(p.name for p in root.iterdir()) == ["a" * 16, "c" * 16, "not-a-run"]


def test_colocated_and_decoupled_runs_share_their_checkpoints(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    colocated = fingerprint(load_config("params.yaml"))
    decoupled = ["train.topology=decoupled", "train.target_ranks=2"]
    assert fingerprint(load_config("params.yaml", decoupled)) == colocated
    assert fingerprint(load_config("params.yaml", ["train.lr=1e-3"])) != colocated


def test_clean_lists_marks_and_removes_runs(tiny_workspace, monkeypatch, capsys):
    monkeypatch.chdir(tiny_workspace)
    config = load_config("params.yaml", ONE_PROCESS)
    root = tiny_workspace / WS.checkpoints
    current = fingerprint(config)[: checkpoint.RUN_ID_CHARS]
    checkpoint.start_run(root, fingerprint(config), {"train": {"lr": 0.003}}, 3)
    checkpoint.start_run(root, "f" * 64, {"batching": {"strategy": "packed"}}, 3)
    sets = [f"--set={o}" for o in ONE_PROCESS]
    assert cli.main(["clean", *sets]) == 0
    out = capsys.readouterr().out
    assert "2 run(s)" in out and f"{current}" in out and "<- the current params" in out
    assert "batching.strategy=packed" in out

    assert cli.main(["clean", "--remove", "nope"]) == 2
    assert "no run nope" in capsys.readouterr().err
    assert cli.main(["clean", "--remove", "ffff"]) == 0
    assert [p.name for p in runs(tiny_workspace)] == [current]
    with workspace_lock(WS.lock, "train"):
        assert cli.main(["clean", "--all"]) == 2
    assert "`dflash train`" in capsys.readouterr().err
    assert cli.main(["clean", "--all"]) == 0
    assert runs(tiny_workspace) == []


@pytest.mark.parametrize("stage", [s for s in stages() if s not in COMMANDS])
def test_every_stage_refuses_a_workspace_another_command_holds(
    tmp_path, monkeypatch, capsys, stage
):
    """Train holds the lock for all of its run: a plan beside it would swap its plans."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(PARAMS)
    with workspace_lock(WS.lock, "train"):
        assert cli.main([stage]) == 2
    assert "`dflash train` (PID" in capsys.readouterr().err


def test_a_refusal_names_the_holding_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(PARAMS)
    with workspace_lock(WS.lock, "train"):
        assert cli.main(["plan"]) == 2
    err = capsys.readouterr().err
    assert f"`dflash train` (PID {os.getpid()})" in err and "Traceback" not in err


def test_ctrl_c_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(PARAMS)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "resolve", lambda stage: interrupted)
    assert cli.main(["tokenize"]) == SIGINT_EXIT
    err = capsys.readouterr().err
    assert err == "dflash tokenize: interrupted; rerun to resume\n"


def test_tokenize_workers_leave_ctrl_c_to_the_parent():
    """A pool worker that took Ctrl-C itself would print a traceback of its own."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from dflash.data import tokenize

    with ProcessPoolExecutor(
        1, mp_context=get_context("fork"), initializer=tokenize._start_worker, initargs=(None,)
    ) as pool:
        handler = pool.submit(signal.getsignal, signal.SIGINT).result()
    assert handler == signal.SIG_IGN


def _as_from_a_terminal() -> None:
    """A shell ignores SIGINT in the jobs it starts in the background, and the ignoring is
    inherited: a suite started with ``&`` would give the launcher no Ctrl-C to handle."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_on_train_stops_every_rank_and_exits_130(tiny_workspace):
    """Ctrl-C goes to the launcher's process group: every process of the job ends, the
    launcher says so in one line, and the run resumes later."""
    long = ["train.epochs=30"]  # minutes of steps: the interrupt comes mid-run
    run_stages(tiny_workspace, ["plan"], long)
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--set=train.checkpoint_every=1"]
    cmd += ["--set=train.num_workers=1", *(f"--set={o}" for o in long)]
    launcher = subprocess.Popen(
        cmd,
        cwd=tiny_workspace,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not checkpoint_written(tiny_workspace, 1):
        time.sleep(0.05)
    tree = psutil.Process(launcher.pid).children(recursive=True)
    assert len(tree) >= 4, tree  # torchrun, two ranks, their loader workers
    commands = {p.pid: " ".join(p.cmdline()) for p in tree}
    os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == SIGINT_EXIT, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "dflash train: interrupted; rerun to resume"
    )
    left = survivors(tree, timeout=1)
    assert not left, f"outlived the launcher: {[commands[p.pid] for p in left]}"


class FinishedJob:
    """``torchrun`` whose rank failed in teardown, after rank 0 wrote the outputs whole."""

    def __init__(self, saved: dict[Path, bytes], code: int) -> None:
        for path, data in saved.items():
            path.write_bytes(data)
        self.code, self.pid = code, os.getpid()

    def wait(self, timeout=None) -> int:
        return self.code


def test_a_rank_failing_after_the_outputs_were_written_does_not_fail_the_run(
    tiny_workspace, monkeypatch, capsys
):
    run_stages(tiny_workspace, ["plan", "train"], ONE_PROCESS)
    monkeypatch.chdir(tiny_workspace)
    config = load_config("params.yaml")
    saved = {tiny_workspace / WS.train_metrics: (tiny_workspace / WS.train_metrics).read_bytes()}
    monkeypatch.setattr(train_stage.subprocess, "Popen", lambda *a, **k: FinishedJob(saved, 1))
    assert train_stage._torchrun(config, Workspace(), lock=os.open(".", os.O_RDONLY)) == 0
    assert "after the run had written its outputs whole" in capsys.readouterr().err

    nothing: dict[Path, bytes] = {}  # killed before the end: train.json never came back
    monkeypatch.setattr(train_stage.subprocess, "Popen", lambda *a, **k: FinishedJob(nothing, 1))
    assert train_stage._torchrun(config, Workspace(), lock=os.open(".", os.O_RDONLY)) == 1


def test_plans_the_disk_cannot_hold_are_refused_before_writing(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)._replace(free=10 * 2**20)
    monkeypatch.setattr(plan_stage.shutil, "disk_usage", lambda path: usage)
    plan_stage.check_disk(1000, 100, tmp_path / "data/plans")
    with pytest.raises(Exception, match=r"train.epochs = 10000: .* at most 163 epochs fit"):
        plan_stage.check_disk(1000, 10000, tmp_path / "data/plans")
    assert not (tmp_path / "data/plans").exists()


def test_epochs_past_the_bound_exit_2_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(PARAMS)
    assert cli.main(["plan", "--set", "train.epochs=2147483647"]) == 2
    assert "train.epochs = 2147483647: must be <= 10000" in capsys.readouterr().err


def test_a_stage_run_by_hand_refuses_inputs_made_from_another_source(tiny_workspace, monkeypatch):
    """The token store was made from the corpus: stats, plan and train on another source
    must not use it, and say which command remakes it."""
    monkeypatch.chdir(tiny_workspace)
    other = ["data.source=data/raw/other.jsonl"]
    for stage in ("stats", "plan", "train"):
        with pytest.raises(StaleInput, match="data.source") as err:
            cli.run_stage(stage, load_config("params.yaml", other))
        assert "`dflash ingest`" in str(err.value)
    with pytest.raises(StaleInput, match=r"data/plans was made with batching.token_budget"):
        cli.run_stage("train", load_config("params.yaml", ["batching.token_budget=512"]))
    cli.run_stage("stats", load_config("params.yaml"))  # the params it was made with pass


def test_an_input_whose_files_changed_since_its_record_proves_nothing(tiny_workspace, monkeypatch):
    """Restored by ``dvc checkout`` or copied in, an output's record no longer describes it."""
    monkeypatch.chdir(tiny_workspace)
    index = tiny_workspace / WS.tokenized / "index.parquet"
    os.utime(index, ns=(index.stat().st_atime_ns, index.stat().st_mtime_ns + 1))
    other = ["data.source=data/raw/other.jsonl"]
    cli.run_stage("stats", load_config("params.yaml", other))


def test_clean_options_are_exclusive():
    from dflash.clean import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--all", "--keep", "1"])
