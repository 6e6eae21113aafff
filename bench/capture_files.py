"""Training from the capture stage's files against colocated training, on CPU.

``python bench/capture_files.py --workspace WS [--max-steps 40]`` copies a workspace whose
stages up to ``plan`` have run (``WS`` itself is never changed), trains a pilot colocated through
``dflash train``, runs ``dflash capture`` with ``train.features=files`` (it logs bytes per
token and the projected total), then trains the same pilot from the files. It prints the
files' bytes per token and size, and one Markdown row per run: tokens/s, target forwards,
final loss and the wall time.
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

RUNS = {"colocated": [], "files": ["train.features=files"]}


def dflash(workspace: Path, stage: str, sets: list[str]) -> float:
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "dflash.cli", stage, *(f"--set={s}" for s in sets)]
    subprocess.run(cmd, cwd=workspace, check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        shutil.copytree(args.workspace, ws, ignore=shutil.ignore_patterns("checkpoints"))
        rows = [
            "| run | tokens/s | target_forwards | final_loss | wall s |",
            "|---|---|---|---|---|",
        ]
        capture_s = 0.0
        for name, sets in RUNS.items():
            if name == "files":  # after the colocated run: train's inputs then say files
                capture_s = dflash(ws, "capture", ["train.features=files"])
            wall = dflash(ws, "train", [f"train.max_steps={args.max_steps}", *sets])
            d = json.loads((ws / "metrics/train_details.json").read_text())
            rows.append(
                f"| {name} | {d['tokens_per_s']:.0f} | {d['target_forwards']} | "
                f"{d['final_loss']:.5f} | {wall:.1f} |"
            )
        info = json.loads((ws / "data/features/features.json").read_text())
        size = sum(p.stat().st_size for p in (ws / "data/features").iterdir())
        print(
            f"capture: {info['bytes_per_token']} bytes per token (states and id), "
            f"{size / 1e6:.1f} MB on disk for {info['tokens']} tokens, {capture_s:.1f} s"
        )
        print("\n".join(rows))


if __name__ == "__main__":
    main()
