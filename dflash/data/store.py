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
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TOKEN_DTYPE = np.uint32
MASK_DTYPE = np.uint8
STORE_TOKENS = "tokens.bin"
STORE_LOSS_MASK = "loss_mask.bin"
STORE_INDEX = "index.parquet"
STORE_MANIFEST = "manifest.json"
"""The four files of a token store directory."""
INDEX_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("offset", pa.int64()),
        ("length", pa.int32()),
        ("n_loss_tokens", pa.int32()),
        ("conversation_id", pa.string()),
    ]
)
INDEX_ROW_GROUP = 65536
"""Index rows per row group: fixed, so the file's bytes never depend on how samples came."""


class TokenStoreWriter:
    """Append samples to a new store in ``directory``, in bounded memory.

    Tokens stream to disk as they come and the index is written a row group at a time, so
    memory holds one batch of samples whatever the corpus size. The store is complete once
    :meth:`close` has written the manifest; callers publish the directory atomically
    (:func:`dflash.fileio.atomic_dir`) so an interrupted run never leaves one that looks done.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._tokens = open(self.directory / STORE_TOKENS, "wb")
        self._mask = open(self.directory / STORE_LOSS_MASK, "wb")
        self._index = pq.ParquetWriter(self.directory / STORE_INDEX, INDEX_SCHEMA)
        self._pending: list[pa.Table] = []
        self._n_pending = 0
        self.n_samples = 0
        self.n_tokens = 0
        self.n_loss_tokens = 0

    def extend(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        lengths: np.ndarray,
        n_loss: np.ndarray,
        ids: list[str],
    ) -> None:
        """Append samples given back to back: ``lengths[i]`` tokens of ``tokens`` and ``mask``,
        ``n_loss[i]`` of them with loss."""
        lengths = np.asarray(lengths, dtype=np.int64)
        loss = np.asarray(n_loss, dtype=np.int64)
        ends = np.cumsum(lengths)
        self._tokens.write(np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE).tobytes())
        self._mask.write(np.ascontiguousarray(mask, dtype=MASK_DTYPE).tobytes())
        table = pa.table(
            {
                "sample_id": np.arange(len(lengths), dtype=np.int64) + self.n_samples,
                "offset": ends - lengths + self.n_tokens,
                "length": lengths.astype(np.int32),
                "n_loss_tokens": loss.astype(np.int32),
                "conversation_id": pa.array(ids, pa.string()),
            },
            schema=INDEX_SCHEMA,
        )
        self._pending.append(table)
        self._n_pending += len(lengths)
        self.n_samples += len(lengths)
        self.n_tokens += int(lengths.sum())
        self.n_loss_tokens += int(loss.sum())
        if self._n_pending >= INDEX_ROW_GROUP:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        pending = pa.concat_tables(self._pending) if self._pending else INDEX_SCHEMA.empty_table()
        whole = len(pending) if final else len(pending) // INDEX_ROW_GROUP * INDEX_ROW_GROUP
        for start in range(0, whole, INDEX_ROW_GROUP):
            self._index.write_table(pending.slice(start, min(INDEX_ROW_GROUP, whole - start)))
        rest = pending.slice(whole)
        self._pending, self._n_pending = ([rest] if len(rest) else []), len(rest)

    def close(self, manifest: dict) -> dict:
        """Write the rest of the index and the manifest (``manifest`` plus counts, dtypes)."""
        self._tokens.close()
        self._mask.close()
        self._flush(final=True)
        self._index.close()
        manifest = {
            **manifest,
            "n_samples": self.n_samples,
            "n_tokens": self.n_tokens,
            "n_loss_tokens": self.n_loss_tokens,
            "dtypes": {
                "tokens": np.dtype(TOKEN_DTYPE).name,
                "loss_mask": np.dtype(MASK_DTYPE).name,
            },
        }
        (self.directory / STORE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest


class TokenStore:
    """Read-only view of a store: ``store[sample_id] -> (ids, loss_mask)`` in O(1).

    The token files are memory-mapped on first access, not at construction, and the maps
    are dropped when pickled, so a store handed to DataLoader workers reopens in each.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest: dict = json.loads((self.directory / STORE_MANIFEST).read_text())
        index = pq.read_table(self.directory / STORE_INDEX)
        self.offsets: np.ndarray = index["offset"].to_numpy()
        self.lengths: np.ndarray = index["length"].to_numpy().astype(np.int32)
        self.n_loss_tokens: np.ndarray = index["n_loss_tokens"].to_numpy().astype(np.int32)
        self.conversation_ids: list[str] = index["conversation_id"].to_pylist()
        n_tokens = self.manifest["n_tokens"]
        for name, dtype in ((STORE_TOKENS, TOKEN_DTYPE), (STORE_LOSS_MASK, MASK_DTYPE)):
            size = (self.directory / name).stat().st_size
            if size != n_tokens * np.dtype(dtype).itemsize:
                raise ValueError(
                    f"{self.directory / name}: {size} bytes, manifest says {n_tokens} tokens "
                    f"of {np.dtype(dtype).name}; the store is incomplete or corrupt"
                )
        self._maps: tuple[np.ndarray, np.ndarray] | None = None
        """Token ids and loss mask, mapped together in one assignment: threads reading
        documents at once (``dflash.features.documents``) never see one map without the other."""

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (uint32) and loss mask (uint8) of one sample, as views of the maps."""
        if not 0 <= sample_id < len(self):
            raise IndexError(f"sample_id {sample_id} out of range for {len(self)} samples")
        if self._maps is None:
            self._maps = (
                self._map(STORE_TOKENS, TOKEN_DTYPE),
                self._map(STORE_LOSS_MASK, MASK_DTYPE),
            )
        tokens, mask = self._maps
        start = int(self.offsets[sample_id])
        stop = start + int(self.lengths[sample_id])
        return tokens[start:stop], mask[start:stop]

    def _map(self, name: str, dtype: type) -> np.ndarray:
        if self.manifest["n_tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.directory / name, dtype=dtype, mode="r")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}
