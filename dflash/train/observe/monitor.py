"""What a run shows while it trains: DVCLive, wandb (offline by default) and DVC plot files.

wandb runs quiet: its history and summary (about 40 lines at the end of a run) stay out of
the terminal, since ``dflash report`` and ``dvc exp show`` hold the figures; ``WANDB_QUIET=false``
brings them back, and ``WANDB_SILENT`` is obeyed as wandb reads it.

Only rank 0 owns a monitor. Every row, and the per-step loss and grad norm the stability
figures come from, is also kept in the checkpoint, so a resumed run ends with the same
complete curves and counts as one that was never interrupted.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.config.schema import Config
from dflash.fileio import write_text_atomic
from dflash.metrics.dvclive import open_live
from dflash.metrics.names import OPTIONAL_COLUMNS, PLOT_COLUMNS, STEP_COLUMNS
from dflash.train.observe.composition import spearman
from dflash.train.observe.stability import is_spike, stability

logger = logging.getLogger(__name__)


class Monitor:
    def __init__(
        self,
        config: Config,
        log_csv: Path,
        live_dir: Path,
        params: dict[str, Any],
        rows: list[dict[str, Any]],
        history: dict[str, list[float]] | None = None,
    ) -> None:
        self.log_csv = log_csv
        self.rows = rows
        self.history = {} if history is None else history
        for key in STEP_COLUMNS:
            self.history.setdefault(key, [])
        self.live = open_live(live_dir)
        for row in rows:  # a resumed run: DVCLive starts over, with the curves so far
            self._log_live(row)
        self.run = None
        if config.logging.wandb != "disabled":
            import wandb  # slow to import: only when it is used

            self.run = wandb.init(
                project=config.logging.project,
                mode=config.logging.wandb,
                config=params,
                dir=os.environ.get("WANDB_DIR", "."),
                settings=wandb.Settings(**wandb_quiet(os.environ)),
            )

    def step(self, result: dict[str, Any], step: int, mean_sample_length: float) -> None:
        """Record one optimizer step's loss, grad norm and mean sample length (finite steps
        only: ``finite`` covers the loss and the grad norm alike)."""
        if not result["finite"]:
            return
        losses = self.history["loss"]
        losses.append(result["loss"])
        self.history["grad_norm"].append(result["grad_norm"])
        self.history["mean_sample_length"].append(mean_sample_length)
        self.history["step"].append(step)
        if is_spike(losses, len(losses) - 1):
            logger.warning(f"loss spike at step {len(losses)}: {losses[-1]:.3f}")

    def stability(self) -> dict:
        """Spikes, grad-norm spread, and how the step loss follows the step's mean length."""
        h = self.history
        return stability(h) | {"loss_length_corr": spearman(h["loss"], h["mean_sample_length"])}

    def _log_live(self, row: dict[str, Any]) -> None:
        self.live.step = row["step"]
        for key in PLOT_COLUMNS[2:] + OPTIONAL_COLUMNS:
            if isinstance(row.get(key), int | float):
                self.live.log_metric(f"train/{key}", row[key])
        for length_class, loss in row.get("loss_by_length", {}).items():
            self.live.log_metric(f"train/loss_by_length/{length_class}", loss)
        self.live.next_step()

    def log(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._log_live(row)
        if self.run is not None:
            names = PLOT_COLUMNS[1:] + OPTIONAL_COLUMNS
            scalars = {f"train/{k}": v for k, v in row.items() if k in names}
            for k, acc in enumerate(row.get("per_position_accuracy", []), start=1):
                scalars[f"accuracy_by_position/{k:02d}"] = acc
            self.run.log(scalars, step=row["step"])
        write_text_atomic(self.log_csv, rows_to_csv(self.rows))

    def finish(self, summary: dict[str, Any], steps_csv: Path | None = None) -> None:
        # Also when no step ran (a finished run reused): the plot files are DVC outputs.
        write_text_atomic(self.log_csv, rows_to_csv(self.rows))
        if steps_csv is not None:
            write_text_atomic(steps_csv, steps_to_csv(self.history))
        numbers = {k: v for k, v in summary.items() if isinstance(v, int | float)}
        self.live.summary.update(numbers)
        self.live.end()
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()


WANDB_OUTPUT_ENV = ("WANDB_QUIET", "WANDB_SILENT")
"""wandb's own variables for how much it prints: a user who sets one gets what it says."""


def wandb_quiet(environ: Mapping[str, str]) -> dict[str, bool]:
    """wandb settings that keep its end-of-run summary off the terminal, unless the
    environment already says how much wandb should print."""
    return {} if any(name in environ for name in WANDB_OUTPUT_ENV) else {"quiet": True}


def steps_to_csv(history: dict[str, list[float]]) -> str:
    series = [history.get(key, []) for key in STEP_COLUMNS]
    if len({len(values) for values in series}) != 1:  # a checkpoint older than the columns
        series = [[] for _ in STEP_COLUMNS]
    lines = [",".join(STEP_COLUMNS)] + [
        ",".join(map(str, row)) for row in zip(*series, strict=True)
    ]
    return "\n".join(lines) + "\n"


def rows_to_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    present = [key for key in OPTIONAL_COLUMNS if any(key in row for row in rows)]
    writer = csv.DictWriter(out, fieldnames=PLOT_COLUMNS + present, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
