"""``colocated``: every rank runs the whole target and trains the drafter on its features."""

from __future__ import annotations

import torch

from dflash.batching.io import Row
from dflash.features.source import Inputs, Kind
from dflash.features.target_forward import micro_batch_features
from dflash.train import simulated
from dflash.train.batches import MicroBatch

PARAM = "train.topology"


class ColocatedFeatures:
    """The rank's own target computes its features, one forward per micro-batch."""

    def __init__(
        self, target: torch.nn.Module, layer_ids: list[int], last: bool = False, heldout=None
    ) -> None:
        self.target, self.layer_ids, self.last = target, layer_ids, last
        self.heldout = heldout or (lambda: None)
        self.forwards = 0

    def start(self, epoch: int, step: int) -> None:
        pass

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        pass

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        self.forwards += 1
        return micro_batch_features(self.target, self.layer_ids, mb, self.last)

    def finish(self) -> dict[str, float]:
        return {
            "target_idle_fraction": 0.0,
            "drafter_wait_fraction": 0.0,
            "target_forwards": self.forwards,
        }


def build(run: Inputs) -> ColocatedFeatures:
    """The target answers the held-out prompts here too (every rank: a sharded target's
    forwards are collectives)."""
    data, files = run.config.data, run.files

    def heldout() -> dict[str, torch.Tensor] | None:
        return simulated.heldout_row(
            files.heldout, run.target, run.tokenizer, run.layer_ids, data.max_seq_len,
            run.autocast, dict(data.chat_template_kwargs),
        )  # fmt: skip

    return ColocatedFeatures(run.target, run.layer_ids, run.last, heldout)


SOURCE = Kind(name="colocated", build=build, whole_target=True)
