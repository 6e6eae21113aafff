"""Does a pilot project the full run? Train the full run and its first ``--fraction`` of steps.

``--lengths pipeline`` (default) needs the pipeline's data and target (`make repro`) and
trains on them with ``params.yaml``; ``--lengths longtail`` needs nothing (the synthetic store
of ``bench/train_throughput.py``). The full run and the pilot (``train.max_steps``) each run
in a scratch directory, full run first. It prints the full run's measured training seconds,
the pilot's ``projected_hours`` in seconds, and their ratio: within 15% is the target.

    python bench/pilot_projection.py [--fraction 0.2] [--set key=value ...]
    python bench/pilot_projection.py --lengths longtail --epochs 1 [--samples 1200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from train_throughput import LINKED, ROOT, build_longtail, dflash_cli, shared_sets

from dflash.pipeline.workspace import RELATIVE


def train(sets: list[str], source: Path) -> dict:
    """Plan and train in a scratch directory linking ``source``'s inputs; its details."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rel in LINKED:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).symlink_to(source / rel)
        dflash_cli("plan", sets, work)
        dflash_cli("train", sets, work)
        return json.loads((work / RELATIVE.train_details).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["pipeline", "longtail"], default="pipeline")
    parser.add_argument("--fraction", type=float, default=0.2)
    parser.add_argument("--samples", type=int, default=1200, help="longtail: samples")
    parser.add_argument("--max-len", type=int, default=1024, help="longtail: longest sample")
    parser.add_argument("--epochs", type=int, default=None, help="default: params.yaml's")
    parser.add_argument("--world-size", type=int, default=None, help="default: params.yaml's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.lengths == "pipeline" and not all((ROOT / rel).exists() for rel in LINKED):
        sys.exit("the pipeline's data is missing: run `make repro` first")
    sets = [*base_sets(args), "logging.wandb=disabled", f"train.checkpoint_every={10**9}"]
    with tempfile.TemporaryDirectory() as tmp:
        source = ROOT if args.lengths == "pipeline" else build_longtail(Path(tmp), args)
        full = train(sets, source)
        steps = max(1, round(args.fraction * full["planned_steps"]))
        pilot = train([*sets, f"train.max_steps={steps}"], source)
    measured, projected = full["train_seconds"], pilot["projected_hours"] * 3600
    print(
        f"\nfull run: {full['steps']} steps, {measured:.0f} s measured "
        f"({full['tokens_per_s']:,.0f} tokens/s)\npilot: {pilot['steps']} steps "
        f"({pilot['steps'] / full['steps']:.0%}), {pilot['train_seconds']:.0f} s, "
        f"{pilot['tokens_per_s']:,.0f} tokens/s, projects {projected:.0f} s: "
        f"{projected / measured - 1:+.1%} against the full run"
    )


def base_sets(args: argparse.Namespace) -> list[str]:
    """The overrides both runs get: the longtail store's, and epochs or ranks if given."""
    if args.lengths == "longtail":
        args.epochs, args.world_size = args.epochs or 1, args.world_size or 1
        return shared_sets(args)
    sets = [f"train.epochs={args.epochs}"] if args.epochs else []
    sets += [f"train.world_size={args.world_size}"] if args.world_size else []
    return sets + args.set


if __name__ == "__main__":
    main()
