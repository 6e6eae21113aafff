"""Parquet storage of normalized conversations, the format every data stage hands on.

One row per conversation: ``conversation_id`` and ``messages``, a list of messages as
:mod:`dflash.data.records` normalizes them (``role``, ``content``, and ``tool_calls`` on
assistant messages that call tools). Files are written in row groups of
:data:`ROW_GROUP` conversations, so writers and readers hold one group in memory whatever
the corpus size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash.fileio import atomic_path

TOOL_CALL = pa.struct(
    [
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(TOOL_CALL))]
)
SCHEMA = pa.schema([("conversation_id", pa.string()), ("messages", pa.list_(MESSAGE))])
ROW_GROUP = 4096
"""Conversations per row group: a few MB of text, the unit of reading and writing."""


class ConversationWriter:
    """Append conversations to a Parquet file, one row group at a time."""

    def __init__(self, path: str | Path) -> None:
        self._writer = pq.ParquetWriter(path, SCHEMA)
        self._rows: list[dict] = []
        self.count = 0

    def write(self, row: dict) -> None:
        self._rows.append(row)
        self.count += 1
        if len(self._rows) == ROW_GROUP:
            self._flush()

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_batch(pa.RecordBatch.from_pylist(self._rows, schema=SCHEMA))
            self._rows = []


def write_conversations(rows: Iterable[dict], path: str | Path) -> None:
    """Write ``rows`` (dicts with ``conversation_id`` and ``messages``) atomically."""
    with atomic_path(path) as tmp:
        writer = ConversationWriter(tmp)
        for row in rows:
            writer.write(row)
        writer.close()


def read_conversations(path: str | Path) -> list[dict]:
    """All conversations of ``path`` as plain dicts, in file order."""
    return [row for chunk in iter_conversations(path, ROW_GROUP) for row in chunk]


def iter_conversations(path: str | Path, chunk_size: int) -> Iterator[list[dict]]:
    """Conversations in chunks of at most ``chunk_size``, reading one chunk at a time."""
    for batch in iter_batches(path, chunk_size):
        yield batch_rows(batch)


def iter_batches(path: str | Path, chunk_size: int) -> Iterator[pa.RecordBatch]:
    """The raw Arrow batches behind :func:`iter_conversations`: cheap to send to a process."""
    parquet = open_parquet(path)
    missing = set(SCHEMA.names) - set(parquet.schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: not a conversations file, missing columns {sorted(missing)}")
    yield from parquet.iter_batches(batch_size=chunk_size, columns=SCHEMA.names)


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A Parquet file to read batch by batch in bounded memory.

    Arrow's default pre-buffering fetches every row group's columns on the first read: the
    whole file in memory (300 MB for 200,000 conversations), however small the batches.
    """
    return pq.ParquetFile(path, pre_buffer=False)


def batch_rows(batch: pa.RecordBatch) -> list[dict]:
    """A batch as dicts; fields a message lacks are absent, as chat templates expect."""
    rows = batch.to_pylist()
    for row in rows:
        row["messages"] = [
            {key: value for key, value in m.items() if value is not None} for m in row["messages"]
        ]
    return rows


def count_conversations(path: str | Path) -> int:
    """Number of rows, from the Parquet footer without reading the data."""
    return pq.ParquetFile(path).metadata.num_rows
