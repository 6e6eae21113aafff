"""The command line's parsers: what each command does (``--help``) and the options it takes.

Which commands exist is ``dvc.yaml``'s (``dflash.pipeline.declaration``); their words are here,
so ``dflash --help`` and ``stages/<stage>.py --help`` say the same.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash.pipeline.declaration import stages

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


def add_stage_args(parser: argparse.ArgumentParser, stage: str) -> None:
    """The params options every stage takes, and the stage's own (:data:`OPTIONS`)."""
    add_config_args(parser)
    if stage in OPTIONS:
        importlib.import_module(OPTIONS[stage]).add_arguments(parser)


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="*",
        metavar="EXP",
        help="experiment names or git revisions, the first the reference; none: the "
        "workspace against HEAD; one: that experiment against the commit it was run from",
    )
    parser.add_argument("--json", action="store_true", help="the same figures as JSON")


def stage_parser(stage: str) -> argparse.ArgumentParser:
    """The parser of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=HELP.get(stage, stage))
    add_stage_args(parser, stage)
    return parser


def command_parser() -> argparse.ArgumentParser:
    """The parser of ``dflash``: a subcommand per stage, and ``compare``."""
    parser = argparse.ArgumentParser(
        prog="dflash",
        description=SUMMARY,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="COMMAND")
    for name in stages():
        summary = HELP.get(name, f"run the {name} stage")
        add_stage_args(sub.add_parser(name, help=summary, description=summary), name)
    add_compare_args(sub.add_parser("compare", help=COMPARE_HELP, description=COMPARE_HELP))
    return parser
