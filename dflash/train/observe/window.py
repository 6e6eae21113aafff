"""The steps between two log lines, summed into one row of ``plots/train/log.csv`` (the rows
:data:`dflash.metrics.names.ROW` and :data:`~dflash.metrics.names.SERIES` name)."""

from __future__ import annotations

from typing import Any


def mean_sample_length(result: dict[str, Any]) -> float:
    """The step's mean sample length in tokens, over all ranks."""
    return result["real_tokens"] / max(result["n_samples"], 1)


class Window:
    """Aggregates the steps between two log lines into one row."""

    def __init__(self) -> None:
        self.loss_w = self.weight = self.seconds = self.wait = 0.0
        self.real = self.padded = self.samples = 0
        self.correct = self.counted = None
        self.grad_norm = self.lr = float("nan")
        self.by_class: dict[str, list[float]] = {}
        """``[Σ loss·weight, Σ weight]`` of the steps of each length class."""

    def add(
        self, result: dict[str, Any], seconds: float, wait: float, length_class: str | None
    ) -> None:
        if result["finite"]:
            self.loss_w += result["loss"] * result["weight"]
            self.weight += result["weight"]
            if length_class is not None:
                sums = self.by_class.setdefault(length_class, [0.0, 0.0])
                sums[0] += result["loss"] * result["weight"]
                sums[1] += result["weight"]
        self.correct = (
            result["correct"] if self.correct is None else self.correct + result["correct"]
        )
        self.counted = (
            result["counted"] if self.counted is None else self.counted + result["counted"]
        )
        self.real += result["real_tokens"]
        self.padded += result["padded_tokens"]
        self.samples += result["n_samples"]
        self.seconds += seconds
        self.wait += wait
        self.grad_norm, self.lr = result["grad_norm"], result["lr"]

    def row(self, step: int, epoch: int) -> dict[str, Any]:
        per_position = (self.correct[1:] / self.counted[1:].clamp(min=1)).tolist()
        return {
            "step": step,
            "epoch": epoch,
            "loss": self.loss_w / max(self.weight, 1e-12),
            "accuracy": float(self.correct[1:].sum() / self.counted[1:].sum().clamp(min=1)),
            "per_position_accuracy": per_position,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.real / max(self.seconds, 1e-9),
            "padded_tokens_per_s": self.padded / max(self.seconds, 1e-9),
            "padding_efficiency": self.real / max(self.padded, 1),
            "mean_sample_length": self.real / max(self.samples, 1),
            "data_wait_fraction": self.wait / max(self.seconds, 1e-9),
            "loss_by_length": {k: lw / max(w, 1e-12) for k, (lw, w) in self.by_class.items()},
        }
