"""The tokenized dataset on disk, and O(1) random access to it.

Layout of a store directory::

    tokens.bin      all samples' token ids back to back, uint32
    loss_mask.bin   one uint8 per token, 1 where the drafter learns
    index.parquet   sample_id, offset, length, n_loss_tokens, conversation_id
    manifest.json   tokenizer hash, counts, dtypes

Flat files plus an index let any worker memory-map the data and slice one sample without
reading the rest, which is what a DataLoader with random batches needs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TOKEN_DTYPE = np.uint32
MASK_DTYPE = np.uint8
INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("offset", pa.int64()),
        ("length", pa.int32()),
        ("n_loss_tokens", pa.int32()),
        ("conversation_id", pa.string()),
    ]
)


class TokenStoreWriter:
    """Append samples to a new store; it appears at ``directory`` only when closed.

    Samples stream to disk as they come, so memory holds one sample plus a few integers of
    index per sample. Writing happens in ``directory.tmp`` that replaces ``directory`` on
    :meth:`close`, so an interrupted run never leaves a store that looks complete.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.tmp = self.directory.with_name(self.directory.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._tokens = open(self.tmp / "tokens.bin", "wb")
        self._mask = open(self.tmp / "loss_mask.bin", "wb")
        self._lengths: list[int] = []
        self._loss: list[int] = []
        self._ids: list[str] = []

    def append(self, ids: np.ndarray, loss_mask: np.ndarray, conversation_id: str) -> None:
        if len(ids) != len(loss_mask):
            raise ValueError(f"{conversation_id}: {len(ids)} tokens but {len(loss_mask)} mask")
        self._tokens.write(np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes())
        self._mask.write(np.ascontiguousarray(loss_mask, dtype=MASK_DTYPE).tobytes())
        self._lengths.append(len(ids))
        self._loss.append(int(np.count_nonzero(loss_mask)))
        self._ids.append(conversation_id)

    def close(self, manifest: dict) -> dict:
        """Write index and manifest (``manifest`` plus counts and dtypes), then publish."""
        self._tokens.close()
        self._mask.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        index = pa.table(
            {
                "sample_id": np.arange(len(lengths), dtype=np.int64),
                "offset": offsets,
                "length": lengths.astype(np.int32),
                "n_loss_tokens": np.asarray(self._loss, dtype=np.int32),
                "conversation_id": pa.array(self._ids, pa.string()),
            },
            schema=INDEX_SCHEMA,
        )
        pq.write_table(index, self.tmp / "index.parquet")
        manifest = {
            **manifest,
            "n_samples": len(lengths),
            "n_tokens": int(lengths.sum()),
            "n_loss_tokens": int(sum(self._loss)),
            "dtypes": {
                "tokens": np.dtype(TOKEN_DTYPE).name,
                "loss_mask": np.dtype(MASK_DTYPE).name,
            },
        }
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(self.directory, ignore_errors=True)
        os.replace(self.tmp, self.directory)
        return manifest


class TokenStore:
    """Read-only view of a store: ``store[sample_id] -> (ids, loss_mask)`` in O(1).

    The token files are memory-mapped on first access, not at construction, and the maps
    are dropped when pickled, so a store handed to DataLoader workers reopens in each.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest: dict = json.loads((self.directory / "manifest.json").read_text())
        index = pq.read_table(self.directory / "index.parquet")
        self.offsets: np.ndarray = index["offset"].to_numpy()
        self.lengths: np.ndarray = index["length"].to_numpy().astype(np.int32)
        self.n_loss_tokens: np.ndarray = index["n_loss_tokens"].to_numpy().astype(np.int32)
        self.conversation_ids: list[str] = index["conversation_id"].to_pylist()
        n_tokens = self.manifest["n_tokens"]
        for name, dtype in (("tokens.bin", TOKEN_DTYPE), ("loss_mask.bin", MASK_DTYPE)):
            size = (self.directory / name).stat().st_size
            if size != n_tokens * np.dtype(dtype).itemsize:
                raise ValueError(
                    f"{self.directory / name}: {size} bytes, manifest says {n_tokens} tokens "
                    f"of {np.dtype(dtype).name}; the store is incomplete or corrupt"
                )
        self._tokens: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (uint32) and loss mask (uint8) of one sample, as views of the maps."""
        if not 0 <= sample_id < len(self):
            raise IndexError(f"sample_id {sample_id} out of range for {len(self)} samples")
        if self._tokens is None:
            self._tokens = self._map("tokens.bin", TOKEN_DTYPE)
            self._mask = self._map("loss_mask.bin", MASK_DTYPE)
        start = int(self.offsets[sample_id])
        stop = start + int(self.lengths[sample_id])
        return self._tokens[start:stop], self._mask[start:stop]

    def _map(self, name: str, dtype: type) -> np.ndarray:
        if self.manifest["n_tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.directory / name, dtype=dtype, mode="r")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_mask": None}
