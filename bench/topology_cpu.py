"""Decoupled against colocated training on CPU: the same epochs, tokens/s and idle fractions.

``python bench/topology_cpu.py --workspace WS`` copies a workspace whose stages up to ``plan``
have run (``WS`` itself is never changed) and trains it three ways, each through ``dflash
train`` with its plan remade for its drafter ranks: 2 colocated ranks, 1 target rank + 1
drafter rank, and 1 target rank + 2 drafter ranks (the default's
``dvc exp run -S train.topology=decoupled -S train.target_ranks=1``). It prints one Markdown
row per run from ``metrics/train_details.json`` and the wall time of ``dflash train``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {
    "2 colocated": ["train.world_size=2"],
    "1 target + 1 drafter": ["train.world_size=1", "train.topology=decoupled"],
    "1 target + 2 drafter": ["train.world_size=2", "train.topology=decoupled"],
}


def dflash(workspace: Path, stage: str, sets: list[str]) -> float:
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "dflash.cli", stage, *(f"--set={s}" for s in sets)]
    subprocess.run(cmd, cwd=workspace, check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    print("| run | wall s | tokens/s | target idle | drafter wait | final loss |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for name, sets in RUNS.items():
            workspace = Path(scratch) / name.replace(" ", "_")
            shutil.copytree(args.workspace, workspace)
            sets = [*sets, f"train.epochs={args.epochs}", "train.target_ranks=1"]
            dflash(workspace, "plan", sets)
            wall = dflash(workspace, "train", sets)
            d = json.loads((workspace / "metrics/train_details.json").read_text())
            print(
                f"| {name} | {wall:.0f} | {d['tokens_per_s']:,.0f} | "
                f"{d['target_idle_fraction']:.1%} | {d['drafter_wait_fraction']:.1%} | "
                f"{d['final_loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
