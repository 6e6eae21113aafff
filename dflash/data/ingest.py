"""The ingest stage: raw conversations in, a clean training split and held-out split out.

Every input record ends up in exactly one place: the training split, the held-out split,
or a counted line of the report (skip reason, duplicate, or left out by
``data.max_conversations``), so nothing disappears without a trace.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.parquet as pq

from dflash import paths
from dflash.config import Config
from dflash.data.chitchat import load_chitchat
from dflash.data.conversations import write_conversations
from dflash.data.records import REASONS, RecordError, content_hash, decode_line, parse_record
from dflash.fileio import write_json_atomic

FIRST_LINES = 5
"""How many line numbers the report keeps per reason: enough to go and look."""


def read_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(line number, record or RecordError)`` for every line of a JSONL file."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                yield number, decode_line(raw)
            except RecordError as err:
                yield number, err


def read_parquet(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(row number, record)`` for every row of a Parquet file, one batch in memory."""
    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def split_key(conversation_id: str) -> float:
    """Uniform in [0, 1) and fixed per id, so the split never depends on file order."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def ingest(
    records: Iterable[tuple[int, object]], eval_fraction: float, max_conversations: int | None
) -> tuple[list[dict], list[dict], dict]:
    """Validate, deduplicate and split numbered records: ``(train, heldout, report)``."""
    skipped = {reason: {"count": 0, "first_lines": []} for reason in REASONS}
    duplicates = {"count": 0, "first_lines": []}
    renamed = {"count": 0, "first_lines": []}
    seen_content: set[str] = set()
    seen_ids: set[str] = set()
    kept: list[dict] = []
    n_read = 0
    for number, record in records:
        n_read += 1
        if isinstance(record, RecordError):
            _note(skipped[record.reason], number)
            continue
        try:
            conversation = parse_record(record)
        except RecordError as err:
            _note(skipped[err.reason], number)
            continue
        digest = content_hash(conversation["messages"])
        if digest in seen_content:
            _note(duplicates, number)
            continue
        seen_content.add(digest)
        if conversation["conversation_id"] in seen_ids:
            conversation["conversation_id"] += f"~{digest[:12]}"
            _note(renamed, number)
        seen_ids.add(conversation["conversation_id"])
        kept.append(conversation)

    heldout = [c for c in kept if split_key(c["conversation_id"]) < eval_fraction]
    train = [c for c in kept if split_key(c["conversation_id"]) >= eval_fraction]
    left_out = 0
    if max_conversations is not None and len(train) > max_conversations:
        chosen = sorted(range(len(train)), key=lambda i: split_key(train[i]["conversation_id"]))
        keep = set(chosen[:max_conversations])
        left_out = len(train) - max_conversations
        train = [c for i, c in enumerate(train) if i in keep]
    report = {
        "records_read": n_read,
        "kept": {"train": len(train), "heldout": len(heldout)},
        "skipped": skipped,
        "skipped_total": sum(s["count"] for s in skipped.values()),
        "duplicates_removed": duplicates,
        "duplicate_ids_renamed": renamed,
        "eval_fraction": eval_fraction,
        "max_conversations": max_conversations,
        "left_out_by_max_conversations": left_out,
    }
    return train, heldout, report


def _note(entry: dict, number: int) -> None:
    entry["count"] += 1
    if len(entry["first_lines"]) < FIRST_LINES:
        entry["first_lines"].append(number)


def run(config: Config) -> None:
    """Read ``data.source`` and write both splits and the report under ``data/ingested``."""
    source = config.data.source
    extra: dict = {}
    if source == "chitchat":
        chats = list(load_chitchat())
        extra["blank_messages_ignored"] = sum(blank for _, blank in chats)
        records: Iterable[tuple[int, object]] = enumerate((r for r, _ in chats), start=1)
    elif source.endswith(".jsonl"):
        records = read_jsonl(source)
    else:
        records = read_parquet(source)
    train, heldout, report = ingest(
        records, config.data.eval_fraction, config.data.max_conversations
    )
    report = {"source": source, **report, **extra}
    write_conversations(train, paths.CONVERSATIONS)
    write_conversations(heldout, paths.HELDOUT)
    write_json_atomic(paths.INGEST_REPORT, report)
    print(
        f"ingest {source}: read {report['records_read']}, train {len(train)}, "
        f"heldout {len(heldout)}, skipped {report['skipped_total']}, "
        f"duplicates {report['duplicates_removed']['count']}, "
        f"left out by max_conversations {report['left_out_by_max_conversations']}"
    )
