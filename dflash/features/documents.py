"""Features a drafter rank reads one document at a time: from serving engines, or from files.

The engine and files sources (:mod:`dflash.features.sources`) fetch each document's states
ahead in plan order, at most ``train.feature_prefetch`` micro-batches in flight, each document
alone (a packed row's documents are separate requests, as the target attends inside each
only), and lay them out where the micro-batch has them. The rank trains as a colocated rank
would, on the same plan. A document that cannot be had ends the run with an error naming it:
nothing trains on zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dflash.batching.io import Row
from dflash.data.store import TokenStore
from dflash.features.engine_client import EngineError
from dflash.features.prefetch import Window
from dflash.features.source import balance
from dflash.train.batches import MicroBatch, micro_batch_shape
from dflash.train.distributed.process_group import Dist

Fetch = Callable[[int, list[int], str], torch.Tensor]
"""``(sample id, its token ids, what to call it in errors) -> [T, n*H]`` states."""


class DocumentFeatures:
    """A drafter rank's features, fetched per document ahead of the micro-batch that uses them;
    a :class:`dflash.features.source.FeatureSource`."""

    def __init__(
        self,
        fetch: Fetch,
        store: TokenStore,
        ctx: Dist,
        width: int,
        dtype: torch.dtype,
        prefetch: int,
        workers: int,
        forwards: Callable[[], int] = lambda: 0,
        heldout: Callable[[], dict[str, torch.Tensor] | None] = lambda: None,
    ) -> None:
        self.fetch, self.store, self.ctx = fetch, store, ctx
        self.width, self.dtype = width, dtype
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="features")
        self.window = Window(prefetch, self._post, EngineError)
        self.forwards = forwards
        self.heldout = heldout

    def start(self, epoch: int, step: int) -> None:
        self.window.restart_clock()

    def epoch(self, steps: list[list[list[Row]]], first_step: int) -> None:
        self.window.epoch(steps, first_step)

    def _post(self, index: int, rows: list[Row]) -> list[Future]:
        what = f"micro-batch {index} of drafter rank {self.ctx.rank}"
        return [
            self.pool.submit(self._document, sample_id, f"{what}, sample {sample_id}")
            for row in rows
            for sample_id, _, _ in row
        ]

    def _document(self, sample_id: int, what: str) -> torch.Tensor:
        ids, _ = self.store[sample_id]
        return self.fetch(sample_id, [int(t) for t in ids], what)

    def _wait(self, index: int, futures: list[Future]) -> list[torch.Tensor]:
        try:
            return [f.result() for f in futures]
        except BaseException:
            self.close()
            raise

    def __call__(self, mb: MicroBatch) -> torch.Tensor:
        index, rows, states = self.window.take(self._wait)
        features = torch.zeros((*micro_batch_shape(rows), self.width), dtype=self.dtype)
        documents = iter(states)
        for r, row in enumerate(rows):
            for _, offset, length in row:
                features[r, offset : offset + length] = next(documents)
        if features.shape[:2] != mb.input_ids.shape:
            raise EngineError(
                f"features of micro-batch {index} of drafter rank {self.ctx.rank} are "
                f"{tuple(features.shape)}, the micro-batch is {tuple(mb.input_ids.shape)}"
            )
        return features.to(self.ctx.device, non_blocking=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def finish(self) -> dict[str, float]:
        self.close()
        busy, wait_s = self.window.busy_s(), self.window.wait_s
        if self.ctx.enabled:
            figures = balance(self.ctx, wait_s, busy, "drafter")
        else:
            wait = wait_s / max(busy + wait_s, 1e-9)
            figures = {"target_idle_fraction": 0.0, "drafter_wait_fraction": wait}
        return figures | {"target_forwards": self.forwards()}
