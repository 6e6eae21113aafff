"""Parquet storage of normalized conversations, the format every data stage hands on.

One row per conversation: ``conversation_id``, ``messages``, a list of messages as
:mod:`dflash.data.records` normalizes them (``role``, ``content``, ``reasoning_content``,
``tool_calls`` with their ``id``, ``tool_call_id`` and ``name`` on tool results), and
``tools``, the conversation's function schemas as JSON text (schemas nest freely, so no Arrow
type fits them all; rows read back hold the parsed list). Files are written in row groups of
:data:`ROW_GROUP` conversations, so writers and readers hold one group in memory whatever
the corpus size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash.fileio import atomic_path

TOOL_CALL = pa.struct(
    [
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ("id", pa.string()),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
    ]
)
ROW_GROUP = 4096
"""Conversations per row group: a few MB of text, the unit of reading and writing."""


class ConversationWriter:
    """Append conversations to a Parquet file, one row group at a time."""

    def __init__(self, path: str | Path) -> None:
        self._writer = pq.ParquetWriter(path, SCHEMA)
        self._rows: list[dict] = []
        self.count = 0

    def write(self, row: dict) -> None:
        self._rows.append(_stored(row))
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


def _stored(row: dict) -> dict:
    """``row`` as a Parquet row: its tool schemas as JSON text."""
    tools = row.get("tools")
    if tools is None or isinstance(tools, str):
        return row
    return {**row, "tools": json.dumps(tools, ensure_ascii=False) if tools else None}


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
    """A batch as dicts; fields a message or conversation lacks are absent, as chat templates
    expect (``tools`` is present only when the conversation has tool schemas)."""
    rows = batch.to_pylist()
    for row in rows:
        row["messages"] = [_present(m) for m in row["messages"]]
        tools = row.pop("tools", None)
        if tools:
            row["tools"] = json.loads(tools)
    return rows


def _present(message: dict) -> dict:
    message = {key: value for key, value in message.items() if value is not None}
    if "tool_calls" in message:
        message["tool_calls"] = [
            {key: value for key, value in call.items() if value is not None}
            for call in message["tool_calls"]
        ]
    return message


def count_conversations(path: str | Path) -> int:
    """Number of rows, from the Parquet footer without reading the data."""
    return pq.ParquetFile(path).metadata.num_rows
