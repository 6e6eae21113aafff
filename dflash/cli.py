"""``dflash <stage> [--params FILE] [--set key=value ...]``: one subcommand per pipeline stage.

Stage implementations live in the library; this module only maps names to them, so
``stages/<stage>.py`` and the console script share one argument parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from dflash.batching.errors import BatchingError
from dflash.config import Config, ConfigError, load_config, restrict

USER_ERRORS = (ConfigError, BatchingError, FileNotFoundError)
"""Errors a user fixes (a param, an input file, a stage to run first): a message and exit 2,
no traceback."""


@dataclass(frozen=True)
class Stage:
    """Where a stage's code starts and which params it reads: the one declaration of both.

    ``params`` decide what the stage writes: ``dvc.yaml`` lists exactly these, so changing one
    reruns the stage (a test holds the two equal). ``knobs`` change only how it runs (workers,
    checkpoint cadence, logging sinks): read, never declared, so they rerun nothing. A stage
    run through this module can read nothing else (``dflash.config.restrict``).
    """

    entry: str
    params: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()


STAGES: dict[str, Stage] = {
    "ingest": Stage(
        "dflash.data.ingest:run",
        params=("data.source", "data.eval_fraction", "data.max_conversations"),
    ),
    "tokenizer": Stage("dflash.data.tokenizer:run", params=("tokenizer", "drafter.mask_token")),
    "target": Stage(
        "dflash.model.target:run",
        params=("target", "data.max_seq_len"),
        knobs=("drafter.num_target_features",),  # checked against the depth, never written
    ),
    "regenerate": Stage(
        "dflash.data.regenerate:run",
        params=("regenerate", "data.regenerate", "data.max_seq_len", "data.chat_template_kwargs"),
    ),
    "tokenize": Stage(
        "dflash.data.tokenize:run",
        params=(
            "data.max_seq_len",
            "data.overlength",
            "data.chunk_size",
            "drafter.block_size",
            "data.turns",
            "data.chat_template_kwargs",
        ),
        knobs=("data.num_workers",),  # the token store is byte-identical for any count
    ),
    "stats": Stage(
        "dflash.batching.stats:run",
        params=(
            "batching.num_buckets",
            "batching.token_budget",
            "batching.max_batch_size",
            "batching.seed",
            "data.max_seq_len",
        ),
    ),
    "plan": Stage(
        "dflash.batching.plan:run",
        params=(
            "batching",
            "data.max_seq_len",
            "train.epochs",
            "train.world_size",
            "train.grad_accum",
        ),
    ),
    "train": Stage(
        "dflash.train.launch:run",
        params=(
            "drafter",
            "train.epochs",
            "train.world_size",
            "train.grad_accum",
            "train.lr",
            "train.warmup_ratio",
            "train.weight_decay",
            "train.betas",
            "train.clip_grad",
            "train.seed",
            # The plan check compares these with the plan's own record of them.
            "batching.strategy",
            "batching.token_budget",
            "batching.max_batch_size",
            "batching.seed",
            "data.max_seq_len",
            # Shapes plots/train/log.csv and the final_accuracy of metrics/train.json.
            "logging.every",
        ),
        knobs=(
            "train.checkpoint_every",
            "train.keep_checkpoints",
            "train.max_nonfinite_steps",
            "train.num_workers",
            "train.prefetch",
            "logging.wandb",
            "logging.project",
        ),
    ),
    "evaluate": Stage(
        "dflash.eval.evaluate:run",
        # gamma weighs the held-out drafter loss; train.seed makes the untrained baseline.
        params=(
            "evaluate",
            "data.max_seq_len",
            "drafter.gamma",
            "train.seed",
            "data.chat_template_kwargs",
        ),
    ),
    "report": Stage("dflash.report:run"),
}


def at_least(low: int):
    """An argparse type for integers >= ``low``: a bad value exits 2 naming flag and bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= {low}")
        return value

    return parse


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
    module, _, func = STAGES[stage].entry.partition(":")
    return getattr(importlib.import_module(module), func)


def run_stage(stage: str, config: Config) -> int:
    """Run ``stage`` on the params it declares, and on those only."""
    declared = STAGES[stage]
    result = resolve(stage)(restrict(config, declared.params + declared.knobs, stage))
    return int(result or 0)


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """Entry point of ``stages/<stage>.py``."""
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=f"dflash {stage}")
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
    except ConfigError as err:
        print(f"dflash {stage}: bad params: {err}", file=sys.stderr)
        return 2
    try:
        return run_stage(stage, config)
    except USER_ERRORS as err:
        missing = isinstance(err, FileNotFoundError) and err.filename
        print(f"dflash {stage}: {f'no such file: {missing}' if missing else err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
