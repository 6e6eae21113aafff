"""A run never erases another run, a workspace has one writer, and stages refuse stale inputs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from conftest import run_stages, survivors

from dflash import cli
from dflash.config.params import load_config
from dflash.fileio import SIGINT_EXIT
from dflash.pipeline import fingerprint as fingerprints
from dflash.pipeline.declaration import COMMANDS, stages
from dflash.pipeline.lock import workspace_lock
from dflash.pipeline.provenance import StaleInput
from dflash.pipeline.workspace import Workspace
from dflash.stages import plan as plan_stage
from dflash.stages import train as train_stage
from dflash.stages.train import fingerprint
from dflash.train.checkpointing import checkpoint
from dflash.train.checkpointing.checkpoint import RunBusy

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


def old_runs(root: Path, *letters: str) -> list[Path]:
    """A run directory per letter (its id that letter 16 times) with a checkpoint's digest,
    the first the least recently written."""
    made = []
    for i, letter in enumerate(letters):
        run = root / (letter * checkpoint.RUN_ID_CHARS)
        run.mkdir(parents=True)
        (run / "step_00000001.sha256").write_text("x")
        os.utime(run / "step_00000001.sha256", (1000 + i, 1000 + i))
        made.append(run)
    return made


@contextmanager
def trained_elsewhere(run: Path) -> Iterator[int]:
    """``run`` held by another live process, as a training run of another workspace that
    shares the checkpoint directory holds it; that process's PID. It is then SIGKILLed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold the run and wait to be killed
        try:
            os.close(read)
            checkpoint.hold_run(run)
            os.write(write, b"held")
            signal.pause()
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 4) == b"held"
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)


def test_runs_past_keep_runs_are_pruned_least_recently_written_first(tmp_path):
    root = tmp_path / "checkpoints"
    current, middle, newest = old_runs(root, "a", "b", "c")
    (root / "not-a-run").mkdir()
    # current: the oldest, but the one starting now: never pruned
    assert checkpoint.prune_runs(root, 2, current) == [middle]
    assert sorted(p.name for p in root.iterdir()) == [current.name, newest.name, "not-a-run"]


def test_a_run_another_process_trains_in_a_shared_directory_is_never_pruned(tmp_path, caplog):
    """Workspaces sharing ``train.checkpoint_dir`` have a lock each: the run's own lock is
    what keeps one from removing the checkpoints of a run that another one is training."""
    root = tmp_path / "shared"
    busy, idle = old_runs(root, "b", "c")
    with trained_elsewhere(busy) as pid:
        try:
            started = checkpoint.start_run(root, "e" * 64, {}, keep_runs=1)
        finally:
            checkpoint.release_runs()
    assert set(checkpoint.run_directories(root)) == {started, busy} and not idle.exists()
    assert sorted(p.name for p in busy.iterdir()) == ["run.lock", "step_00000001.sha256"]
    said = f"kept the checkpoints of run {busy.name} past train.keep_runs: in use by PID {pid} on"
    assert said in caplog.text
    # Its process killed, the kernel freed the lock: the run is pruned like any other.
    assert checkpoint.prune_runs(root, 1, started) == [busy]


def test_a_run_another_process_trains_is_refused_and_one_this_process_holds_is_not(tmp_path):
    (run,) = old_runs(tmp_path, "b")
    with trained_elsewhere(run) as pid:
        with pytest.raises(RunBusy, match=f"PID {pid} on .*train.checkpoint_dir"):
            checkpoint.hold_run(run)
    try:
        checkpoint.hold_run(run)
        checkpoint.hold_run(run)  # held already by this process: no refusal of itself
        assert (run / checkpoint.RUN_LOCK).read_text().startswith(f"{os.getpid()} ")
    finally:
        checkpoint.release_runs()
    assert checkpoint.remove_run(run) is None and not run.exists()


def no_current_run(monkeypatch, tmp_path) -> None:
    """A workspace of params only, whose current run ``dflash clean`` need not fingerprint
    (hashing the train stage's code takes seconds)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(PARAMS)
    monkeypatch.setattr("dflash.commands.clean._current", lambda config, workspace: None)


def test_a_killed_trainer_frees_its_run_while_its_forked_workers_live_on(tmp_path):
    """Loader workers are forked from the training process and outlive it for a moment: the
    run's lock is the trainer's alone, freed the moment it dies."""
    (run,) = old_runs(tmp_path, "b")
    read, write = os.pipe()
    trainer = os.fork()
    if trainer == 0:
        try:
            checkpoint.hold_run(run)
            if os.fork() == 0:  # the worker
                os.write(write, f"{os.getpid():>16}".encode())
            signal.pause()
        finally:
            os._exit(0)
    os.close(write)
    worker = int(os.read(read, 16))
    try:
        assert checkpoint.remove_run(run).startswith(f"in use by PID {trainer} on ")
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
        os.kill(worker, 0)  # alive, and holding the trainer's descriptors
        assert checkpoint.remove_run(run) is None and not run.exists()
    finally:
        os.kill(worker, signal.SIGKILL)
        os.close(read)


def test_clean_keeps_a_run_another_process_trains_and_says_so(tmp_path, monkeypatch, capsys):
    no_current_run(monkeypatch, tmp_path)
    shared = tmp_path / "shared"
    busy, idle = old_runs(shared, "b", "c")
    with trained_elsewhere(busy) as pid:
        assert cli.main(["clean", "--all", f"--set=train.checkpoint_dir={shared}"]) == 0
    out = capsys.readouterr().out
    assert f"kept run {busy.name}: in use by PID {pid} on " in out
    assert f"removed run {idle.name}" in out and f"1 run(s) under {shared}" in out
    assert checkpoint.run_directories(shared) == [busy]


def test_a_dangling_link_in_a_run_blocks_neither_a_start_nor_clean(tmp_path, monkeypatch, capsys):
    no_current_run(monkeypatch, tmp_path)
    root = tmp_path / WS.checkpoints
    for run in old_runs(root, "b", "c"):
        (run / "gone").symlink_to(tmp_path / "nowhere")
    try:
        checkpoint.start_run(root, "c" * 64, {}, keep_runs=3)  # lists every run, prunes none
    finally:
        checkpoint.release_runs()
    # Dated by the link's own time, the run just started is the most recently written.
    assert [run.name for run in runs(tmp_path)] == ["c" * 16, "b" * 16]
    assert cli.main(["clean", "--remove", "bbbb"]) == 0
    out = capsys.readouterr().out
    assert f"removed run {'b' * 16}" in out and "1 run(s) under" in out
    assert cli.main(["clean", "--all"]) == 0
    assert not any(root.iterdir())


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
    checkpoint.release_runs()  # as a run does when it ends
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
def test_ctrl_c_on_train_stops_every_rank_and_exits_130(tiny_workspace, hold):
    """Ctrl-C goes to the launcher's process group: every process of the job ends, the
    launcher says so in one line, and the run resumes later. The ranks hold after their
    first checkpoint (tests/hold.py): the interrupt comes mid-run."""
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--set=train.checkpoint_every=1"]
    cmd += ["--set=train.num_workers=1"]
    launcher = subprocess.Popen(
        cmd,
        cwd=tiny_workspace,
        env=hold.env(1, ENV),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )
    hold.wait(launcher)
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
        assert "made with data.source = 'data/raw/corpus.jsonl'" in str(err.value)
        assert "this run has data.source = 'data/raw/other.jsonl'" in str(err.value)
    with pytest.raises(StaleInput, match=r"data/plans was made with batching.token_budget") as err:
        cli.run_stage("train", load_config("params.yaml", ["batching.token_budget=512"]))
    assert "token_budget = 384, but this run has batching.token_budget = 512" in str(err.value)
    cli.run_stage("stats", load_config("params.yaml"))  # the params it was made with pass


OTHER_SOURCE = ["data.source=data/raw/other.jsonl"]
"""A source the tiny workspace's token store was not made from."""


def test_an_input_whose_contents_changed_since_its_record_proves_nothing(
    tiny_workspace, monkeypatch
):
    """Rewritten in place, even at its old size and modification time, an output's record no
    longer describes it: the stage is not refused, and records nothing of that input."""
    monkeypatch.chdir(tiny_workspace)
    other = load_config("params.yaml", OTHER_SOURCE)
    with pytest.raises(StaleInput):
        cli.run_stage("stats", other)  # the record holds, and its digests are cached
    tokens = WS.tokenized / "tokens.bin"
    before = tokens.stat()
    data = bytearray(tokens.read_bytes())
    data[0] ^= 1
    tokens.write_bytes(bytes(data))
    os.utime(tokens, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = tokens.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    written = (WS.provenance / "stats.json").stat().st_mtime_ns
    assert cli.run_stage("stats", other) == 0
    record = json.loads((WS.provenance / "stats.json").read_text())
    assert (WS.provenance / "stats.json").stat().st_mtime_ns > written
    assert "data.source" not in record["params"] and "batching.token_budget" in record["params"]


def test_a_copy_that_rounds_file_times_is_read_again_and_still_refused(tiny_workspace, monkeypatch):
    """``cp -r``, ``tar``, ``rsync`` and ``dvc checkout`` may drop sub-second times: the copy is
    hashed again, its record still holds, and an unchanged file is not read twice."""
    monkeypatch.chdir(tiny_workspace)
    shutil.copytree(WS.tokenized, "copied")
    shutil.rmtree(WS.tokenized)
    Path("copied").rename(WS.tokenized)
    for file in WS.tokenized.rglob("*"):
        whole = file.stat().st_mtime_ns // 10**9 * 10**9
        os.utime(file, ns=(whole, whole))
    real, read = fingerprints.sha256_file, []
    monkeypatch.setattr(fingerprints, "sha256_file", lambda path: read.append(path) or real(path))
    other = load_config("params.yaml", OTHER_SOURCE)
    for again in (False, True):
        read.clear()
        with pytest.raises(StaleInput, match="data.source") as err:
            cli.run_stage("stats", other)
        message = str(err.value)
        assert "data.source = 'data/raw/corpus.jsonl'" in message
        assert "data.source = 'data/raw/other.jsonl'" in message
        assert bool(read) != again, read  # hashed once, then known by inode, size and times


def test_clean_options_are_exclusive():
    from dflash.commands.clean import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--all", "--keep", "1"])
