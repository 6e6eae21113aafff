"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

The command line only parses and dispatches: which stages exist, where their code starts and
which params they read are declared in ``dvc.yaml`` (``dflash.pipeline.declaration``), so
``stages/<stage>.py``, the console script and DVC share one declaration. The words of
``--help`` are :mod:`dflash.commands.parsers`'s, how a command ends
:mod:`dflash.commands.exits`'s.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import nullcontext
from pathlib import Path

from dflash import heap, logs
from dflash.commands import exits
from dflash.commands.parsers import COMPARE, OPTIONS, command_parser, stage_parser
from dflash.config.params import load_config
from dflash.config.schema import Config
from dflash.errors import ConfigError
from dflash.pipeline import provenance
from dflash.pipeline.declaration import COMMANDS, restrict, stages
from dflash.pipeline.lock import launched_by_torchrun, workspace_lock
from dflash.pipeline.workspace import Workspace


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
    takes it in its launcher, which hands it to its ranks; the commands beside the pipeline
    only read, or take it themselves. Its inputs must have been made from the params it is
    given, and its outputs are recorded as made from them (:mod:`dflash.pipeline.provenance`).
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
        with heap.imports_settled():
            entry = resolve(stage)
        result = int(entry(restricted, workspace, *extra) or 0)
        if pipeline and result == 0:
            provenance.record(stage, config, workspace)
    return result


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    heap.skip_exit_collection()
    return _run(stage, stage_parser(stage).parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dflash`` and ``python -m dflash.cli`` (each torchrun rank)."""
    heap.skip_exit_collection()
    args = command_parser().parse_args(argv)
    if args.stage == "compare":  # by name, like report: no stage's code depends on it
        return importlib.import_module(COMPARE).run(args, Path("."))
    return _run(args.stage, args)


def _run(stage: str, args: argparse.Namespace) -> int:
    """Load the params, then run ``stage``: a bad params file exits 2 in one line, and so does
    each failure :func:`dflash.commands.exits.ended` knows."""
    try:
        config = load_config(args.params, args.overrides)
    except ConfigError as err:
        print(f"dflash {stage}: bad params: {err}", file=sys.stderr)
        return 2
    options = args if stage in OPTIONS else None
    return exits.ended(stage, lambda: run_stage(stage, config, options=options))


if __name__ == "__main__":
    sys.exit(main())
