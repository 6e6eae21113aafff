"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

The command line only parses and dispatches: which stages exist, where their code starts and
which params they read are declared in ``dvc.yaml`` (``dflash.declaration``), so
``stages/<stage>.py``, the console script and DVC share one declaration.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from dflash import logs
from dflash.config import Config
from dflash.declaration import restrict, stages
from dflash.errors import ConfigError, OutputError, UserError
from dflash.fileio import exit_on_sigterm
from dflash.params import load_config
from dflash.workspace import Workspace

SUMMARY = "Train a DFlash draft model for a target LLM: a command per pipeline stage, and report."
EPILOG = """\
`dvc repro` runs every stage in order, each only when its inputs changed;
`dflash COMMAND` runs one now. Beside them:
  python -m dflash.publish DIR   copy the evaluated drafter with its scorecard to DIR
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
    "train": "train the drafter on the target's hidden states over the planned batches "
    "(torchrun, train.world_size ranks), then export it with its model card to models/drafter",
    "evaluate": "decode prompts greedily and with the drafter: tau, speedups against n-gram "
    "and an untrained drafter, and a check that the output is the target's own",
    "report": "print one screen of every stage's figures, with warnings that say what to change",
}
"""What each command does, for ``--help``."""
COMPARE_HELP = (
    "paired differences in tau and training figures between DVC experiments or revisions, "
    "with bootstrap intervals"
)
"""``dflash compare`` reads runs from git, not params: no stage and no ``dvc.yaml`` entry."""
COMPARE = "dflash.compare.command"


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


def run_stage(stage: str, config: Config, workspace: Workspace | None = None) -> int:
    """Run ``stage`` on the params it declares, and on those only, in ``workspace`` (by default
    the working directory, where DVC runs stages); its log lines name it."""
    logs.setup(stage)
    declared = stages()[stage]
    restricted = restrict(config, declared.params + declared.knobs)
    result = resolve(stage)(restricted, workspace or Workspace())
    return int(result or 0)


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=HELP.get(stage, stage))
    add_config_args(parser)
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
        add_config_args(sub.add_parser(name, help=summary, description=summary))
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
    try:
        with exit_on_sigterm():
            return run_stage(stage, config)
    except (UserError, FileNotFoundError) as err:
        missing = isinstance(err, FileNotFoundError) and err.filename
        print(f"dflash {stage}: {f'no such file: {missing}' if missing else err}", file=sys.stderr)
        return 2
    except OutputError as err:  # disk full, no permission, read-only: the machine, exit 1
        print(f"dflash {stage}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
