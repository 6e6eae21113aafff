"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

The command line only parses and dispatches: which stages exist, where their code starts and
which params they read are declared in ``dvc.yaml`` (``dflash.declaration``), so
``stages/<stage>.py``, the console script and DVC share one declaration.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash.config import Config
from dflash.declaration import restrict, stages
from dflash.errors import ConfigError, OutputError, UserError
from dflash.fileio import exit_on_sigterm
from dflash.params import load_config


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


def run_stage(stage: str, config: Config) -> int:
    """Run ``stage`` on the params it declares, and on those only."""
    declared = stages()[stage]
    result = resolve(stage)(restrict(config, declared.params + declared.knobs))
    return int(result or 0)


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=f"dflash {stage}")
    add_config_args(parser)
    return _run(stage, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name in stages():
        add_config_args(sub.add_parser(name, help=f"run the {name} stage"))
    return _run(None, parser.parse_args(argv))


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
