"""Per-epoch batch plans for the chosen strategy, and their figures (the plan stage).

``plan_epoch`` is a pure function of (lengths, params, epoch): the generator of an epoch is
``default_rng([seed, epoch])``, so the same inputs give byte-identical files anywhere and a
resumed or re-planned run sees exactly the same batches.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.batching import io
from dflash.batching.boundaries import boundaries_by, explicit_boundaries
from dflash.batching.choices import BOUNDARY_METHODS, strategy_names
from dflash.batching.cost import CostModel
from dflash.batching.distribute import distribute
from dflash.batching.errors import BatchingError
from dflash.batching.lengths import check_lengths, read_lengths
from dflash.batching.metrics import epoch_metrics, overall
from dflash.batching.params import PlanParams
from dflash.batching.registry import strategies, strategy
from dflash.batching.validate import validate_plans
from dflash.config.params import at_least
from dflash.config.schema import BatchingConfig, Config
from dflash.fileio import atomic_dir, require_only

logger = logging.getLogger(__name__)


def plan_epoch(lengths: np.ndarray, params: PlanParams, epoch: int) -> pa.Table:
    """One epoch's plan table, rows in plan order (step, rank, micro, row, offset)."""
    layout = strategy(params.strategy).layout
    for name in ("token_budget", "max_seq_len", "max_batch_size", "world_size", "grad_accum"):
        if getattr(params, name) < 1:
            raise BatchingError(f"{name} = {getattr(params, name)}: must be >= 1")
    check_lengths(lengths, params.max_seq_len, params.token_budget)
    rng = np.random.default_rng([params.seed, epoch])
    return distribute(
        layout(lengths, params, rng),
        lengths,
        params.world_size,
        params.grad_accum,
        epoch,
        rng,
        params.cost,
    )


def plan_meta(lengths: np.ndarray, params: PlanParams, epochs: int) -> dict[str, Any]:
    """What a plan was made from; a trainer compares it with its own run before using it."""
    meta = asdict(params)
    meta["boundaries"] = list(params.boundaries) if params.boundaries is not None else None
    meta["cost"] = asdict(params.cost)
    return {
        "lengths_sha256": io.lengths_fingerprint(lengths),
        "n_samples": int(lengths.size),
        **meta,
        "epochs": epochs,
    }


def write_plans(
    lengths: np.ndarray, params: PlanParams, epochs: int, out_dir: str | Path
) -> dict[str, Any]:
    """Write ``epoch_EEE.parquet`` for every epoch and ``summary.json``; return the summary.

    ``out_dir`` is replaced whole, so it appears complete or not at all (a plan killed
    half-way leaves the previous one); it may hold only plan files before.
    """
    if epochs < 1:
        raise BatchingError(f"epochs = {epochs}: must be >= 1")
    require_only(out_dir, [io.PLAN_EPOCH_GLOB, io.PLAN_SUMMARY])
    meta = plan_meta(lengths, params, epochs)
    per_epoch, previous = [], None
    with atomic_dir(out_dir) as tmp:
        for epoch in range(epochs):
            table = plan_epoch(lengths, params, epoch)
            figures, previous = epoch_metrics(table, lengths.size, previous, params.cost)
            io.write_epoch(table, io.epoch_path(tmp, epoch), meta)
            per_epoch.append(figures)
        summary = {**overall(per_epoch), "epochs": per_epoch, "meta": meta}
        io.write_summary(summary, tmp)
    return summary


def resolve_boundaries(
    spec: str | list[int] | None,
    lengths: np.ndarray,
    num_buckets: int,
    max_seq_len: int,
    buckets_json: Path | None = None,
) -> tuple[int, ...]:
    """Edges from a method name (read from ``buckets_json`` if given, else computed) or a list."""
    if isinstance(spec, list):
        return tuple(explicit_boundaries(spec, lengths, max_seq_len))
    method = spec or "optimal"
    if method not in BOUNDARY_METHODS:
        allowed = ", ".join(BOUNDARY_METHODS)
        raise BatchingError(f"boundaries {method!r}: allowed are {allowed} or a list")
    if buckets_json is None:
        return tuple(boundaries_by(method, lengths, num_buckets))
    if not buckets_json.exists():
        raise FileNotFoundError(f"{buckets_json} does not exist: run `dflash stats` first")
    edges = json.loads(buckets_json.read_text())[method]["boundaries"]
    if edges[-1] < int(lengths.max()):
        raise BatchingError(
            f"{buckets_json} ends at {edges[-1]} but a sample has {int(lengths.max())} tokens: "
            "it was computed from other data; rerun `dflash stats`"
        )
    return tuple(edges)


def params_from_config(config: Config, lengths: np.ndarray, buckets_json: Path) -> PlanParams:
    b = config.batching
    boundaries = None
    if strategy(b.strategy).uses_buckets:
        boundaries = resolve_boundaries(
            b.boundaries,
            lengths,
            b.num_buckets,
            config.data.max_seq_len,
            buckets_json=buckets_json,
        )
    return PlanParams(
        strategy=b.strategy,
        token_budget=b.token_budget,
        max_seq_len=config.data.max_seq_len,
        max_batch_size=b.max_batch_size,
        world_size=config.train.world_size,
        grad_accum=config.train.grad_accum,
        seed=b.seed,
        boundaries=boundaries,
        cost=CostModel(
            anchors_per_document=config.drafter.anchors_per_sequence,
            block_size=config.drafter.block_size,
            slot_cost=b.slot_cost,
        ),
    )


def headline(summary: dict[str, Any]) -> str:
    keys = ("n_steps", "padding_efficiency", "cost_imbalance", "frozen_batch_fraction")
    return ", ".join(
        f"{k}={summary[k]:.4g}" if summary[k] is not None else f"{k}=n/a" for k in keys
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash.batching.planner [...]`` plans a lengths file; ``... validate DIR``
    checks one."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        return _validate_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m dflash.batching.planner", description=main.__doc__
    )
    parser.add_argument("--lengths", required=True, help="Parquet file with a 'length' column")
    parser.add_argument(
        "--strategy", required=True, choices=strategy_names(), help=_strategies_help()
    )
    parser.add_argument("--token-budget", type=at_least(1), required=True)
    parser.add_argument("--max-seq-len", type=at_least(1), required=True)
    parser.add_argument("--max-batch-size", type=at_least(1), required=True)
    parser.add_argument("--epochs", type=at_least(1), default=1)
    parser.add_argument("--world-size", type=at_least(1), default=1)
    parser.add_argument("--grad-accum", type=at_least(1), default=1)
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument(
        "--boundaries",
        default=_default("boundaries"),
        help=" | ".join([*BOUNDARY_METHODS, "b0,b1,..."]),
    )
    parser.add_argument("--num-buckets", type=at_least(1), default=_default("num_buckets"))
    parser.add_argument("--anchors", type=at_least(0), default=0, help="drafter anchors/document")
    parser.add_argument("--block-size", type=at_least(1), default=16)
    parser.add_argument(
        "--slot-cost",
        type=float,
        default=_default("slot_cost"),
        help="a block slot's cost in target tokens (with --anchors)",
    )
    parser.add_argument("--out", required=True, help="directory for the epoch files")
    args = parser.parse_args(argv)
    try:
        lengths = read_lengths(args.lengths)
        params = PlanParams(
            strategy=args.strategy,
            token_budget=args.token_budget,
            max_seq_len=args.max_seq_len,
            max_batch_size=args.max_batch_size,
            world_size=args.world_size,
            grad_accum=args.grad_accum,
            seed=args.seed,
            cost=CostModel(args.anchors, args.block_size, args.slot_cost),
        )
        if strategy(args.strategy).uses_buckets:
            spec = args.boundaries
            if spec not in BOUNDARY_METHODS:
                spec = [int(b) for b in spec.split(",")]
            edges = resolve_boundaries(spec, lengths, args.num_buckets, args.max_seq_len)
            params = replace(params, boundaries=edges)
        summary = write_plans(lengths, params, args.epochs, args.out)
    except (ValueError, OSError) as err:
        print(f"dflash.batching.planner: {err}", file=sys.stderr)
        return 2
    print(headline(summary))
    return 0


def _default(name: str) -> Any:
    """A ``batching`` param's default, so the command and ``params.yaml`` agree when omitted."""
    return BatchingConfig.model_fields[name].default


def _strategies_help() -> str:
    """Each strategy's line, for ``--help`` (argparse reads ``%`` as a format)."""
    return "; ".join(f"{n}: {s.doc}" for n, s in strategies().items()).replace("%", "%%")


def _validate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash.batching.planner validate",
        description="check every invariant of a plan",
    )
    parser.add_argument("plans_dir")
    parser.add_argument("--lengths", required=True)
    args = parser.parse_args(argv)
    try:
        summary = validate_plans(args.plans_dir, read_lengths(args.lengths))
    except (ValueError, OSError) as err:
        print(f"invalid plan: {err}", file=sys.stderr)
        return 1
    print(f"ok: {len(summary['epochs'])} epochs, {summary['n_steps']} steps, all invariants hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
