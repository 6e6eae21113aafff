"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

The command line only parses and dispatches: which stages exist, where their code starts and
which params they read are declared in ``dvc.yaml`` (``dflash.pipeline.declaration``), so
``stages/<stage>.py``, the console script and DVC share one declaration.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import NoReturn

from dflash import logs
from dflash.config.params import load_config
from dflash.config.schema import Config
from dflash.errors import ConfigError, OutputError, RunStopped, UserError
from dflash.fileio import SIGINT_EXIT, SIGTERM_EXIT, exit_on_sigterm
from dflash.pipeline import provenance
from dflash.pipeline.declaration import COMMANDS, restrict, stages
from dflash.pipeline.lock import FAILURE_LOG, launched_by_torchrun, record_exit, workspace_lock
from dflash.pipeline.workspace import Workspace

SUMMARY = "Train a DFlash draft model for a target LLM: a command per pipeline stage, and report."
EPILOG = """\
`dvc repro` runs every stage in order, each only when its inputs changed;
`dflash COMMAND` runs one now. Beside them:
  python -m dflash.commands.publish DIR   copy the evaluated drafter with its scorecard to DIR
  dvc exp run -S KEY=VALUE       an experiment with one param changed (see README.md)
"""
HELP = {
    "ingest": "read data.source, drop invalid and duplicate conversations, split off held-out",
    "tokenizer": "train a byte-level BPE or adopt tokenizer.path, with the drafter's mask token",
    "target": "pretrain the tiny default target, or check and reference target.path",
    "regenerate": "replace every assistant turn with the target's own answer to train on",
    "tokenize": "render the chats with the template into a token store with loss masks",
    "stats": "sample length statistics and the bucket boundaries each method would choose",
    "plan": "plan every epoch's micro-batches with batching.strategy and score their padding",
    "capture": "write every training sample's target features once to data/features/ "
    "(train.features files; otherwise only a manifest), saying their size first",
    "train": "train the drafter on the target's hidden states over the planned batches "
    "(torchrun, train.world_size ranks), then export it with its model card to models/drafter",
    "evaluate": "decode prompts greedily and with the drafter: tau, speedups against n-gram "
    "and an untrained drafter, and a check that the output is the target's own",
    "report": "print one screen of every stage's figures, with warnings that say what to change",
    "clean": "list the runs whose checkpoints are kept under checkpoints/, and remove them",
}
"""What each command does, for ``--help``."""
OPTIONS = {"clean": "dflash.commands.clean", "train": "dflash.train.distributed.nodes"}
"""Commands with options of their own: the module's ``add_arguments`` adds them, and its
``run`` takes the parsed options as a third argument."""
COMPARE_HELP = (
    "paired differences in tau and training figures between DVC experiments or revisions, "
    "with bootstrap intervals"
)
"""``dflash compare`` reads runs from git, not params: no stage and no ``dvc.yaml`` entry."""
COMPARE = "dflash.commands.compare.command"


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params", default="params.yaml", help="params file (default: params.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one param by dotted key, e.g. --set batching.strategy=packed",
    )


def resolve(stage: str):
    module, _, func = stages()[stage].entry.partition(":")
    return getattr(importlib.import_module(module), func)


def run_stage(
    stage: str,
    config: Config,
    workspace: Workspace | None = None,
    options: argparse.Namespace | None = None,
) -> int:
    """Run ``stage`` on the params it declares, and on those only, in ``workspace`` (by default
    the working directory, where DVC runs stages); its log lines name it.

    A pipeline stage holds the workspace's lock while it runs (``dflash.pipeline.lock``): train
    takes
    it in its launcher, which hands it to its ranks; the commands beside the pipeline only
    read, or take it themselves. Its inputs must have been made from the params it is given,
    and its outputs are recorded as made from them (:mod:`dflash.pipeline.provenance`).
    """
    logs.setup(stage)
    workspace = workspace or Workspace()
    declared = stages()[stage]
    pipeline = stage not in COMMANDS and not launched_by_torchrun()
    locked = pipeline and stage != "train"
    with workspace_lock(workspace.lock, stage) if locked else nullcontext():
        if pipeline:
            provenance.check(stage, config, workspace)
        restricted = restrict(config, declared.params + declared.knobs)
        extra = () if options is None else (options,)
        result = int(resolve(stage)(restricted, workspace, *extra) or 0)
        if pipeline and result == 0:
            provenance.record(stage, config, workspace)
    return result


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=HELP.get(stage, stage))
    add_config_args(parser)
    if stage in OPTIONS:
        importlib.import_module(OPTIONS[stage]).add_arguments(parser)
    return _run(stage, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash",
        description=SUMMARY,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="COMMAND")
    for name in stages():
        summary = HELP.get(name, f"run the {name} stage")
        command = sub.add_parser(name, help=summary, description=summary)
        add_config_args(command)
        if name in OPTIONS:
            importlib.import_module(OPTIONS[name]).add_arguments(command)
    add_compare_args(sub.add_parser("compare", help=COMPARE_HELP, description=COMPARE_HELP))
    args = parser.parse_args(argv)
    if args.stage == "compare":  # by name, like report: no stage's code depends on it
        return importlib.import_module(COMPARE).run(args, Path("."))
    return _run(None, args)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="EXP",
        help="experiment names or git revisions, the first the reference; none: the "
        "workspace against HEAD; one: that experiment against the commit it was run from",
    )
    parser.add_argument("--json", action="store_true", help="the same figures as JSON")


def _run(stage: str | None, args: argparse.Namespace) -> int:
    stage = stage or args.stage
    try:
        config = load_config(args.params, args.overrides)
    except ConfigError as err:
        print(f"dflash {stage}: bad params: {err}", file=sys.stderr)
        return 2
    options = args if stage in OPTIONS else None
    try:
        with exit_on_sigterm():
            return run_stage(stage, config, options=options)
    except KeyboardInterrupt:
        print(f"dflash {stage}: interrupted; rerun to resume", file=sys.stderr)
        return SIGINT_EXIT
    except SystemExit as ended:
        if ended.code != SIGTERM_EXIT:
            raise
        print(f"dflash {stage}: terminated (SIGTERM); rerun to resume", file=sys.stderr)
        return SIGTERM_EXIT
    except (UserError, FileNotFoundError, OutputError, RunStopped) as err:
        code = _report(stage, err)
        if launched_by_torchrun():
            _exit_rank(code)  # here, while ``err`` still holds what it would free
        return code
    except Exception as err:
        if launched_by_torchrun():
            _report_crash(stage, err)
            _exit_rank(1)
        raise


def _report(stage: str, err: Exception) -> int:
    """Print ``err`` in one line; its exit status: 2 for the user's input, 1 for the machine
    (disk full, no permission, read-only)."""
    missing = isinstance(err, FileNotFoundError) and err.filename
    print(f"dflash {stage}: {f'no such file: {missing}' if missing else err}", file=sys.stderr)
    return 1 if isinstance(err, OutputError | RunStopped) else 2


def _report_crash(stage: str, err: Exception) -> None:
    """A rank's unexpected error: its traceback in the job's failure log, where the launcher
    set one (:mod:`dflash.train.distributed.agent`), and one line naming the rank, the error and
    the log;
    else the traceback."""
    log, rank = os.environ.get(FAILURE_LOG), os.environ.get("RANK", "0")
    try:
        with open(log or "", "a") as f:
            f.write(f"rank {rank}: {''.join(traceback.format_exception(err))}")
    except OSError:  # no log (torchrun run by hand), or none to write
        traceback.print_exception(err)
        return
    message = next(iter(str(err).strip().splitlines()), "")
    print(
        f"dflash {stage}: rank {rank}: {type(err).__name__}: {message} (traceback: {log})",
        file=sys.stderr,
    )


def _exit_rank(code: int) -> NoReturn:
    """End a failed torchrun rank without the interpreter's teardown. Freeing a gloo process
    group (held by DDP in the failed frames) joins its worker thread with the GIL held, while
    that thread may wait for the GIL to free the last collective's tensors (torch 2.13): the
    rank would hang, and torchrun would hold every node's job open waiting for it. Outputs are
    written whole or not at all, so nothing is left to flush but the streams."""
    record_exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
