"""Parquet storage of normalized conversations, the format every data stage hands on.

One row per conversation: ``conversation_id`` and ``messages``, a list of ``{role, content}``
with roles ``system``, ``user``, ``assistant``. Files are written to a temporary name and
renamed, so a stage killed mid-write never leaves a truncated file that looks finished.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash.fileio import atomic_path

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([("conversation_id", pa.string()), ("messages", pa.list_(MESSAGE))])


def write_conversations(rows: Iterable[dict], path: str | Path) -> None:
    """Write ``rows`` (dicts with ``conversation_id`` and ``messages``) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    table = pa.table(
        {
            "conversation_id": pa.array([r["conversation_id"] for r in rows], pa.string()),
            "messages": pa.array(
                [
                    [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
                    for r in rows
                ],
                pa.list_(MESSAGE),
            ),
        },
        schema=SCHEMA,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_conversations(path: str | Path) -> list[dict]:
    """All conversations of ``path`` as plain dicts, in file order."""
    return [row for chunk in iter_conversations(path, 65536) for row in chunk]


def iter_conversations(path: str | Path, chunk_size: int) -> Iterator[list[dict]]:
    """Conversations in chunks of at most ``chunk_size``, reading one chunk at a time."""
    parquet = pq.ParquetFile(path)
    missing = set(SCHEMA.names) - set(parquet.schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: not a conversations file, missing columns {sorted(missing)}")
    for batch in parquet.iter_batches(batch_size=chunk_size, columns=SCHEMA.names):
        yield batch.to_pylist()


def count_conversations(path: str | Path) -> int:
    """Number of rows, from the Parquet footer without reading the data."""
    return pq.ParquetFile(path).metadata.num_rows
