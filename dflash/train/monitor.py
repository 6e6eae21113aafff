"""What a run shows while it trains: wandb (offline by default) and DVC plot/metric files.

Only rank 0 owns a monitor. Every row is also kept in the checkpoint, so a resumed run ends
with the same complete curves as one that was never interrupted.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

from dflash import paths
from dflash.config import Config
from dflash.fileio import write_text_atomic

PLOT_COLUMNS = [
    "step",
    "epoch",
    "loss",
    "accuracy",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "padded_tokens_per_s",
    "padding_efficiency",
    "mean_sample_length",
    "data_wait_fraction",
]


class Monitor:
    def __init__(self, config: Config, plots_dir: Path, rows: list[dict[str, Any]]) -> None:
        self.plots_dir = plots_dir
        self.rows = rows
        self.run = None
        if config.logging.wandb != "disabled":
            import wandb  # slow to import: only when it is used

            self.run = wandb.init(
                project=config.logging.project,
                mode=config.logging.wandb,
                config=config.to_dict(),
                dir=os.environ.get("WANDB_DIR", "."),
            )

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.run is not None:
            scalars = {f"train/{k}": v for k, v in row.items() if k in PLOT_COLUMNS[1:]}
            for k, acc in enumerate(row.get("per_position_accuracy", []), start=1):
                scalars[f"accuracy_by_position/{k:02d}"] = acc
            self.run.log(scalars, step=row["step"])
        write_text_atomic(self.plots_dir / paths.TRAIN_LOG.name, rows_to_csv(self.rows))

    def finish(self, summary: dict[str, Any]) -> None:
        # Also when no step ran (a finished run reused): the plot file is a DVC output.
        write_text_atomic(self.plots_dir / paths.TRAIN_LOG.name, rows_to_csv(self.rows))
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()


def rows_to_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=PLOT_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
