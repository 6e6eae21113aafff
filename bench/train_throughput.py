"""Train throughput per batching strategy on the tiny default.

Needs the pipeline's data and target (`make repro`, or `dvc repro tokenize stats`). For each
strategy it plans one epoch and trains it in a scratch directory that links the real
artefacts, then prints real and padded tokens/s, padding efficiency, the share of step
time spent waiting for data and the training seconds, with ratios against the `sorted`
baseline of the same run.

    python bench/train_throughput.py [--epochs 1] [--world-size 1] [--strategies a,b]
        [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKED = ["data/tokenized", "data/stats", "models/target", "models/tokenizer"]


def run_strategy(strategy: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rel in LINKED:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).symlink_to(ROOT / rel)
        sets = [
            f"batching.strategy={strategy}",
            f"train.epochs={args.epochs}",
            f"train.world_size={args.world_size}",
            "logging.wandb=disabled",
            f"train.checkpoint_every={10**9}",
            *args.set,
        ]
        flags = [x for s in sets for x in ("--set", s)]
        params = ["--params", str(ROOT / "params.yaml")]
        subprocess.run(
            [sys.executable, "-m", "dflash.cli", "plan", *params, *flags], cwd=work, check=True
        )
        subprocess.run(
            [sys.executable, "-m", "dflash.cli", "train", *params, *flags],
            cwd=work,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // args.world_size))},
        )
        return json.loads((work / "metrics/train.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--strategies", default="sorted,shuffle,bucketed,packed")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra params override for every run, e.g. drafter.anchors_per_sequence=128",
    )
    args = parser.parse_args()
    for rel in LINKED:
        if not (ROOT / rel).exists():
            sys.exit(f"{rel} is missing: run `make repro` (or `dvc repro stats`) first")
    results = {s: run_strategy(s, args) for s in args.strategies.split(",")}
    base = results.get("sorted") or next(iter(results.values()))
    overrides = f" with {', '.join(args.set)}" if args.set else ""
    print(
        f"\nworld size {args.world_size}, {args.epochs} epoch(s), tiny default params.yaml"
        f"{overrides}"
    )
    header = (
        f"{'strategy':<10}{'eff':>7}{'tok/s':>10}{'pad tok/s':>11}{'vs sorted':>11}"
        f"{'data wait':>11}{'train s':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, m in results.items():
        print(
            f"{name:<10}{m['padding_efficiency']:>7.3f}{m['tokens_per_s']:>10.0f}"
            f"{m['padded_tokens_per_s']:>11.0f}{m['tokens_per_s'] / base['tokens_per_s']:>10.2f}x"
            f"{m['data_wait_fraction']:>10.1%}{m['train_seconds']:>9.0f}"
        )


if __name__ == "__main__":
    main()
