"""The train stage (``dflash train``, ``python stages/train.py``): check, lock, launch.

The launching process takes the workspace's lock (:mod:`dflash.pipeline.lock`), checks the
plans and the world size once, and only then starts ``torchrun`` (through
:mod:`dflash.train.distributed.agent`, which ends a failed job in one line) with the resolved
params handed over in a temporary file, so ``--set`` overrides reach every rank. The job has
``train.world_size`` ranks, plus ``train.target_ranks`` when ``train.topology`` is decoupled
(``dflash.features.sources.decoupled``). ``torchrun`` inherits the lock and dies with the
launcher; each rank dies with ``torchrun``. Run under ``torchrun`` directly, rank 0 takes the
lock itself.

``torchrun`` runs in a session of its own, so Ctrl-C reaches the launcher alone: it stops the
job as SIGTERM does, quietly, and exits 130 with one line. A rank that fails
after the run wrote its outputs whole (``metrics/train.json`` last, naming the drafter's
digest) does not make the finished run a failure.

The lock comes before torch and transformers are imported (seconds): a second run on a busy
workspace is refused at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import yaml

from dflash.config.schema import Config
from dflash.fileio import remove_files
from dflash.heap import imports_settled
from dflash.pipeline.closure import declared_inputs
from dflash.pipeline.declaration import declared_params, unrestricted
from dflash.pipeline.lock import (
    EXIT_DIR,
    FAILURE_LOG,
    HELD_BY_LAUNCHER,
    launched_by_torchrun,
    refused,
    workspace_lock,
)
from dflash.pipeline.workspace import Workspace
from dflash.train.distributed.allocator import configure_allocator
from dflash.train.distributed.nodes import Nodes
from dflash.train.distributed.orphans import die_with_parent, parent_death_signal
from dflash.train.run_files import Declared, TrainFiles, weight_inputs

ONE_NODE = Nodes()
"""A job on this machine alone, which tests launch without node options."""


def train_files(workspace: Workspace, config: Config) -> TrainFiles:
    w, init, shared = workspace, config.drafter.init_from, config.train.checkpoint_dir
    return TrainFiles(
        tokenized=w.tokenized,
        plans=w.plans,
        target=w.target,
        tokenizer=w.tokenizer,
        heldout=w.heldout,
        checkpoints=w.checkpoints if shared is None else w.root / shared,
        drafter=w.drafter,
        metrics=w.train_metrics,
        details=w.train_details,
        log=w.train_log,
        live=w.train_live,
        init=None if init is None else w.root / init,
        steps=w.train_steps,
        buckets=w.stats_buckets,
        features=w.features,
        hidden_states=w.hidden_states,
    )


def declared(config: Config) -> Declared:
    return Declared(declared_params(config), declared_inputs(config, "train"))


def fingerprint(config: Config, workspace: Workspace | None = None) -> str:
    """The checkpoint fingerprint a run of ``config`` in ``workspace`` resumes only into."""
    from dflash.train.checkpointing.checkpoint import run_fingerprint

    files = train_files(workspace or Workspace(), config)
    return run_fingerprint(files, weight_inputs(files, declared(config)))


def run(config: Config, workspace: Workspace, options: argparse.Namespace | None = None) -> int:
    configure_allocator(os.environ)  # before any CUDA use here, and inherited by the ranks
    if launched_by_torchrun():
        return _rank(config, workspace)
    return _launch(config, workspace, options)


def _rank(config: Config, workspace: Workspace) -> int:
    with imports_settled():
        from dflash.train.distributed.node_checks import agree_params
        from dflash.train.distributed.process_group import init_distributed
        from dflash.train.loop import train

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun stops its ranks, blocked or not
    die_with_parent()
    own_lock = HELD_BY_LAUNCHER not in os.environ and os.environ.get("RANK") == "0"
    with workspace_lock(workspace.lock, "train") if own_lock else nullcontext():
        job = declared(config)
        agree_params(init_distributed(), job.params)  # before any rank splits the job by them
        train(config, train_files(workspace, config), job)
    return 0


def _launch(config: Config, workspace: Workspace, options: argparse.Namespace | None) -> int:
    with workspace_lock(workspace.lock, "train") as lock:
        with imports_settled():  # preflight's: torch, and transformers for the target's config
            from dflash.train.distributed.nodes import nodes_of
            from dflash.train.distributed.ranks import processes
            from dflash.train.preflight import preflight

            nodes = nodes_of(options, processes(config.train), config.train)
            files = train_files(workspace, config)
            preflight(config, files, nodes.count)
        if processes(config.train) == 1:
            with imports_settled():
                from dflash.train.loop import train

            train(config, files, declared(config))
            return 0
        return _torchrun(config, workspace, lock, nodes, options)


def _torchrun(
    config: Config,
    workspace: Workspace,
    lock: int,
    nodes: Nodes = ONE_NODE,
    options: argparse.Namespace | None = None,
) -> int:
    from dflash.train.distributed import agent
    from dflash.train.distributed.nodes import torchrun_args, worker_command
    from dflash.train.distributed.ranks import processes

    if nodes.many and nodes.rank == 0:
        joins = "\n".join(f"  {worker_command(nodes, options, r)}" for r in range(1, nodes.count))
        print(
            f"dflash train: each worker node joins, in its copy of the workspace:\n{joins}",
            file=sys.stderr,
            flush=True,
        )
    remove_files(workspace.train_metrics)  # written last by this job: present = it finished
    remove_files(workspace.train_failures)  # this job's failures only
    with tempfile.TemporaryDirectory(prefix="dflash-train-") as scratch:
        params = Path(scratch) / "params.yaml"
        params.write_text(yaml.safe_dump(unrestricted(config).model_dump(mode="json")))
        cmd = [
            sys.executable,
            "-m",
            agent.__name__,
            str(config.train.rendezvous_timeout_s),
            *torchrun_args(nodes, processes(config.train)),
            f"--max-restarts={config.train.max_restarts}",
            *("-m", "dflash.cli", "train", "--params", str(params)),
        ]
        failures = str(workspace.train_failures.relative_to(workspace.root))  # from its cwd
        env = {**os.environ, HELD_BY_LAUNCHER: "1", EXIT_DIR: scratch, FAILURE_LOG: failures}
        job = subprocess.Popen(
            cmd,
            cwd=workspace.root,  # the ranks' workspace, wherever the launcher's caller runs
            env=env,
            pass_fds=(lock,),
            preexec_fn=parent_death_signal(),
            start_new_session=True,
        )
        code = _wait(job)
        if code != 0 and refused(Path(scratch)):
            code = 2  # a rank refused the input: the user's to fix, as on one process
        failed = agent.first_failure(Path(scratch))
    return _outcome(config, workspace, code, failed)


def _outcome(config: Config, workspace: Workspace, code: int, failed: int | None) -> int:
    """The job's exit status, said: a run that wrote its outputs whole is complete whatever
    rank failed after; in a decoupled job, the failed rank's role."""
    from dflash.train.distributed.ranks import RankLayout

    if code != 0 and _finished(workspace):
        print(
            f"dflash train: a rank exited {code} after the run had written its outputs whole "
            f"({workspace.train_metrics} names the drafter it exported); the run is complete",
            file=sys.stderr,
        )
        return 0
    t = config.train
    if code != 0 and t.topology == "decoupled":
        layout = RankLayout(t.world_size, t.target_ranks)
        which = "a rank" if failed is None else layout.describe(failed)
        print(f"dflash train: {which} failed; {layout.roles()}", file=sys.stderr)
    return code


def _wait(job: subprocess.Popen) -> int:
    """The job's exit status; interrupted (Ctrl-C, SIGTERM), the job is stopped first."""
    try:
        return job.wait()
    except BaseException:
        _stop(job)
        raise


def _stop(job: subprocess.Popen) -> None:
    """End ``torchrun`` at once and quietly (on a signal of its own it prints a traceback):
    its ranks die with it, their loader workers with them, and the run resumes from its last
    checkpoint."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def _finished(workspace: Workspace) -> bool:
    from dflash.pipeline.freshness import stale_drafter

    return workspace.train_metrics.exists() and stale_drafter(workspace.root) is None
