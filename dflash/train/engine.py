"""Features a drafter rank reads one document at a time: from serving engines, or from files.

``train.topology: engine`` asks vLLM servers (:mod:`dflash.model.hidden_states`);
``train.features: files`` reads what the ``capture`` stage wrote once. Either way the rank
trains as a colocated rank would, on the same plan: :class:`DocumentFeatures` has the seam of
:class:`dflash.train.topology.DecoupledFeatures` (start, epoch, a call per micro-batch,
finish). Its documents are fetched ahead in plan order, at most ``train.feature_prefetch``
micro-batches in flight, each document alone (a packed row's documents are separate
requests, as the target attends inside each only), and laid out where the micro-batch has them.
A document that cannot be had ends the run with an error naming it: nothing trains on zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dflash.batching.io import Row
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.model.hidden_states import (
    BadStates,
    EngineClient,
    EngineError,
    checked,
    hidden_transfer,
)
from dflash.train.batches import MicroBatch
from dflash.train.capture import SAMPLE, CapturedFiles, CaptureError, check_capture, distills
from dflash.train.distributed.process_group import Dist
from dflash.train.prefetch import Window
from dflash.train.run_files import TrainFiles
from dflash.train.topology import fractions, micro_batch_shape

Fetch = Callable[[int, list[int], str], torch.Tensor]
"""``(sample id, its token ids, what to call it in errors) -> [T, n*H]`` states."""

REQUESTS_PER_ENDPOINT = 8
"""Documents in flight per endpoint: the engine batches them itself."""


class DocumentFeatures:
    """A drafter rank's features, fetched per document ahead of the micro-batch that uses them."""

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
    ) -> None:
        self.fetch, self.store, self.ctx = fetch, store, ctx
        self.width, self.dtype = width, dtype
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="features")
        self.window = Window(prefetch, self._post, EngineError)
        self.forwards = forwards

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
            balance = fractions(self.ctx, wait_s, busy, "drafter")
        else:
            wait = wait_s / max(busy + wait_s, 1e-9)
            balance = {"target_idle_fraction": 0.0, "drafter_wait_fraction": wait}
        return balance | {"target_forwards": self.forwards()}


def served_fetch(client) -> Fetch:
    """Each document a request to the engines (:class:`dflash.model.hidden_states.EngineClient`)."""

    def fetch(sample_id: int, token_ids: list[int], what: str) -> torch.Tensor:
        return client.states(token_ids, what)

    return fetch


def file_fetch(
    transfer, layers: int, hidden: int, dtype: torch.dtype, directory: Path, keep: int | None = None
) -> Fetch:
    """Each document read from the ``capture`` stage's files by ``transfer`` (hs-connectors'
    reader, or :class:`dflash.train.capture.CapturedFiles`, which checks each file's digest),
    checked as engine states are: the first ``keep`` of the ``layers`` states it holds per
    token (all of them by default). A file that is not what the run reads names itself."""
    width = hidden * (layers if keep is None else keep)

    def fetch(sample_id: int, token_ids: list[int], what: str) -> torch.Tensor:
        try:
            sample = transfer.get_cached(sample_id)
            return checked(sample, token_ids, layers, hidden, dtype)[:, :width]
        except (BadStates, OSError) as err:
            raise CaptureError(
                f"{what}: {directory / SAMPLE.format(sample_id)}: {err}; rerun `dflash capture` "
                "with train.features files"
            ) from err

    return fetch


def document_features(
    config: Config, files: TrainFiles, ctx: Dist, target: torch.nn.Module, layer_ids: list[int]
) -> DocumentFeatures:
    """The features of ``train.features: files``, or of ``train.topology: engine``."""
    t, e = config.train, config.engine
    hidden, n = target.config.hidden_size, len(layer_ids)
    dtype = target.get_input_embeddings().weight.dtype
    store = TokenStore(files.tokenized)
    if t.features == "files":
        last = distills(config)  # the KL reads the last hidden state after the layers
        stored = check_capture(files.features, layer_ids, hidden, last, config)
        transfer = CapturedFiles(files.features)
        fetch = file_fetch(transfer, stored, hidden, dtype, files.features, n + last)
        width = (n + last) * hidden
        return DocumentFeatures(fetch, store, ctx, width, dtype, t.feature_prefetch, 2)
    client = EngineClient(
        e.endpoints, hidden_transfer(e.backend, files.hidden_states), n, hidden, dtype,
        model=e.model, timeout_s=e.timeout_s, max_retries=e.max_retries,
    )  # fmt: skip
    workers = REQUESTS_PER_ENDPOINT * len(e.endpoints)
    return DocumentFeatures(
        served_fetch(client), store, ctx, n * hidden, dtype, t.feature_prefetch, workers,
        forwards=lambda: client.requests,
    )  # fmt: skip


def by_document(train) -> bool:
    """Whether a rank's features come document by document: from engines or from files."""
    return train.features == "files" or train.topology == "engine"
