"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

Stage implementations live in the library; this module only maps names to them, so
``stages/<stage>.py`` and the console script share one argument parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash.config import Config, ConfigError, load_config

STAGES: dict[str, str] = {
    "ingest": "dflash.data.ingest:run",
    "tokenizer": "dflash.data.tokenizer:run",
    "target": "dflash.model.target:run",
    "regenerate": "dflash.data.regenerate:run",
    "tokenize": "dflash.data.tokenize:run",
    "stats": "dflash.batching.stats:run",
    "plan": "dflash.batching.plan:run",
    "train": "dflash.train.launch:run",
    "evaluate": "dflash.eval.evaluate:run",
    "report": "dflash.report:run",
}


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


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.params, args.overrides)


def resolve(stage: str):
    module, _, func = STAGES[stage].partition(":")
    return getattr(importlib.import_module(module), func)


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=f"stages/{stage}.py", description=f"dflash {stage}")
    add_config_args(parser)
    return _run(stage, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name in STAGES:
        add_config_args(sub.add_parser(name, help=f"run the {name} stage"))
    return _run(None, parser.parse_args(argv))


def _run(stage: str | None, args: argparse.Namespace) -> int:
    stage = stage or args.stage
    try:
        config = config_from_args(args)
        result = resolve(stage)(config)
    except ConfigError as err:
        print(f"dflash {stage}: bad params: {err}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
