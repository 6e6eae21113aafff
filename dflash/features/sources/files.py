"""``files``: the features the ``capture`` stage wrote once, read back document by document.

An experiment that changes only batching or training runs no target forward. Each document's
file is checked as engine states are, and against its digest in the manifest
(:mod:`dflash.features.feature_files`); the held-out batch comes with the files when a target
in process captured them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.data.store import TokenStore
from dflash.features.documents import DocumentFeatures, Fetch
from dflash.features.engine_client import BadStates, checked
from dflash.features.feature_files import (
    SAMPLE,
    CapturedFiles,
    CaptureError,
    check_capture,
    read_heldout_row,
)
from dflash.features.source import Inputs, Kind
from dflash.features.target_forward import feature_dtype
from dflash.model.layer_ids import feature_width, states_per_token

PARAM = "train.features"

READERS = 2
"""Files read at once."""


def file_fetch(
    transfer, layers: int, hidden: int, dtype: torch.dtype, directory: Path, keep: int | None = None
) -> Fetch:
    """Each document read from the ``capture`` stage's files by ``transfer`` (hs-connectors'
    reader, or :class:`dflash.features.feature_files.CapturedFiles`, which checks each file's
    digest), checked as engine states are: the first ``keep`` of the ``layers`` states it holds
    per token (all of them by default). A file that is not what the run reads names itself."""
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


def build(run: Inputs) -> DocumentFeatures:
    files, ctx = run.files, run.placement.ctx
    hidden, dtype = run.target.config.hidden_size, feature_dtype(run.target)
    stored = check_capture(files.features, run.layer_ids, hidden, run.last, run.config)
    keep = states_per_token(run.layer_ids, run.last)
    fetch = file_fetch(CapturedFiles(files.features), stored, hidden, dtype, files.features, keep)
    return DocumentFeatures(
        fetch, TokenStore(files.tokenized), ctx, feature_width(run.layer_ids, hidden, run.last),
        dtype, run.config.train.feature_prefetch, READERS,
        heldout=lambda: read_heldout_row(files.features, ctx.device),
    )  # fmt: skip


SOURCE = Kind(name="files", build=build)
