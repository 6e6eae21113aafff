"""Ingesting: raw conversations in, a clean training split and held-out split out.

Every input record ends up in exactly one place: the training split, the held-out split,
or a counted line of the report (skip reason, duplicate, or left out by
``data.max_conversations``), so nothing disappears without a trace.

Records stream through: both splits are written row group by row group as records arrive,
and deduplication keeps a 16-byte digest per conversation, not the conversation, so memory
stays flat whatever the corpus size. The outputs appear together or not at all.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash.config.params import outside_message
from dflash.data.chitchat import load_chitchat
from dflash.data.conversations import SCHEMA, ConversationWriter, iter_batches, open_parquet
from dflash.data.records import BOM, REASONS, RecordError, content_digest, decode_line, parse_record
from dflash.errors import ConfigError
from dflash.fileio import not_a_file

FIRST_LINES = 5
"""How many line numbers the report keeps per reason: enough to go and look."""
READ_BATCH = 4096
"""Parquet rows decoded to Python at a time."""
MAX_LINE_BYTES = 64 << 20
"""A JSONL line longer than this is counted as ``too_long`` and skipped unread: a file with
no newline at all must not be pulled into memory whole."""
SKIP_CHUNK = 1 << 20
UNCAPPED = "uncapped.parquet"
"""Scratch file beside the training split while ``data.max_conversations`` cuts it."""


class NoConversationsError(RuntimeError):
    """No record of the source became a training conversation; ``report`` says why."""

    def __init__(self, report: dict) -> None:
        super().__init__(f"{report['source']}: no usable training conversations")
        self.report = report


def read_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(line number, record or RecordError)`` for every line of a JSONL file."""
    with open(path, "rb") as file:
        for number, raw in enumerate(_lines(file), start=1):
            if raw is None:
                yield number, RecordError("too_long", f"line over {MAX_LINE_BYTES} bytes")
                continue
            if number == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw.strip():  # a blank line holds no record: not one to count
                continue
            try:
                yield number, decode_line(raw)
            except RecordError as err:
                yield number, err


def _lines(file) -> Iterator[bytes | None]:
    """The file's lines, each at most ``MAX_LINE_BYTES``; None stands for a longer one."""
    while raw := file.readline(MAX_LINE_BYTES + 1):
        if len(raw) <= MAX_LINE_BYTES:
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = file.readline(SKIP_CHUNK)
        yield None


def read_parquet(path: str | Path, key: str = "data.source") -> Iterator[tuple[int, object]]:
    """``(row number, record)`` for every row of a Parquet file, one batch in memory.

    The file is opened before the first row is asked for, so one that is not Parquet is
    refused before any output is begun.
    """
    parquet = _not_parquet_is_a_config_error(path, key, lambda: open_parquet(path))

    def rows() -> Iterator[tuple[int, object]]:
        number = 0
        batches = parquet.iter_batches(batch_size=READ_BATCH)
        while batch := _not_parquet_is_a_config_error(path, key, lambda: next(batches, None)):
            for row in batch.to_pylist():
                number += 1
                yield number, row

    return rows()


def _not_parquet_is_a_config_error(path: str | Path, key: str, read):
    try:
        return read()
    except (pa.ArrowException, OSError) as err:
        why = " ".join(str(err).split())  # Arrow's messages span lines; the error is one
        raise ConfigError(f"{key} = {str(path)!r}: not a readable Parquet file: {why}") from None


def id_digest(conversation_id: str) -> bytes:
    """SHA-256 of an id: its first 16 bytes identify it, its first 8 place it in a split."""
    return hashlib.sha256(conversation_id.encode("utf-8")).digest()


def split_key(conversation_id: str) -> float:
    """Uniform in [0, 1) and fixed per id, so the split never depends on file order."""
    return _key(id_digest(conversation_id)) / 2**64


def _key(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


class Tally:
    """The report's counts, and what deduplication must remember: 16 bytes per record."""

    def __init__(self, need_answer: bool = True) -> None:
        self.need_answer = need_answer
        self.records_read = 0
        self.skipped = {reason: _entry() for reason in REASONS}
        self.duplicates = _entry()
        self.renamed = _entry()
        self.seen_content: set[bytes] = set()
        self.seen_ids: set[bytes] = set()

    def accept(self, number: int, record: object) -> tuple[dict, bytes] | None:
        """The conversation and its id digest, or None when skipped or a duplicate (counted)."""
        self.records_read += 1
        try:
            if isinstance(record, RecordError):
                raise record
            conversation = parse_record(record, self.need_answer)
            content = content_digest(conversation["messages"])
        except RecordError as err:
            _note(self.skipped[err.reason], number)
            return None
        except RecursionError:  # a record the reader took, too deep to normalise or hash
            _note(self.skipped["too_deep"], number)
            return None
        content = content_digest(conversation["messages"], conversation.get("tools", ()))
        if content in self.seen_content:
            _note(self.duplicates, number)
            return None
        self.seen_content.add(content)
        digest = id_digest(conversation["conversation_id"])
        if digest[:16] in self.seen_ids:
            conversation["conversation_id"] += f"~{content.hex()[:12]}"
            digest = id_digest(conversation["conversation_id"])
            _note(self.renamed, number)
        self.seen_ids.add(digest[:16])
        return conversation, digest


def ingest(
    records: Iterable[tuple[int, object]],
    train_path: Path,
    heldout_path: Path,
    eval_fraction: float,
    max_conversations: int | None,
) -> dict:
    """Validate, deduplicate and split numbered records into the two files; returns the report."""
    tally = Tally()
    capped = train_path.with_name(UNCAPPED) if max_conversations is not None else train_path
    train, heldout = ConversationWriter(capped), ConversationWriter(heldout_path)
    train_keys = array("Q")  # 8 bytes a training conversation, for data.max_conversations
    for number, record in records:
        accepted = tally.accept(number, record)
        if accepted is None:
            continue
        conversation, digest = accepted
        if _key(digest) / 2**64 < eval_fraction:
            heldout.write(conversation)
        else:
            train.write(conversation)
            train_keys.append(_key(digest))
    train.close()
    heldout.close()
    n_train = len(train_keys)
    if max_conversations is not None:
        n_train = cap_split(
            capped, train_path, np.asarray(train_keys, np.uint64), max_conversations
        )
        capped.unlink()
    return {
        "records_read": tally.records_read,
        "kept": {"train": n_train, "heldout": heldout.count},
        "skipped": tally.skipped,
        "skipped_total": sum(s["count"] for s in tally.skipped.values()),
        "duplicates_removed": tally.duplicates,
        "duplicate_ids_renamed": tally.renamed,
        "eval_fraction": eval_fraction,
        "max_conversations": max_conversations,
        "left_out_by_max_conversations": len(train_keys) - n_train,
    }


def cap_split(source: Path, out: Path, keys: np.ndarray, limit: int) -> int:
    """Copy the ``limit`` rows of smallest split key, in file order; returns how many.

    Keyed by id like the split itself, so the kept subset does not depend on file order.
    """
    keep = np.zeros(len(keys), dtype=bool)
    keep[np.argsort(keys, kind="stable")[:limit]] = True
    with pq.ParquetWriter(out, SCHEMA) as writer:
        start = 0
        for batch in iter_batches(source, READ_BATCH):
            writer.write_batch(batch.filter(pa.array(keep[start : start + len(batch)])))
            start += len(batch)
    return int(keep.sum())


def _entry() -> dict:
    return {"count": 0, "first_lines": []}


def _note(entry: dict, number: int) -> None:
    entry["count"] += 1
    if len(entry["first_lines"]) < FIRST_LINES:
        entry["first_lines"].append(number)


def open_source(source: str, roots: tuple[Path, ...]) -> tuple[Iterable[tuple[int, object]], dict]:
    """Numbered records of ``data.source`` (a file under ``roots``, as for ``open_records``),
    and a dict of source-specific counts to report.

    The counts fill in as the records are read.
    """
    if source == "chitchat":
        extra = {"blank_messages_ignored": 0}

        def chats() -> Iterator[dict]:
            for record, blank in load_chitchat():
                extra["blank_messages_ignored"] += blank
                yield record

        return enumerate(chats(), start=1), extra
    return open_records(source, "data.source", roots), {}


def open_records(path: str, key: str, roots: tuple[Path, ...]) -> Iterable[tuple[int, object]]:
    """Numbered records of a ``.jsonl`` / ``.parquet`` file named by ``key``, under the first of
    ``roots`` (the directory ``dvc.yaml`` tracks) or, links resolved, any of them (DVC's cache
    it links to)."""
    why = not_a_file(path)
    if why:
        raise ConfigError(f"{key} = {path!r}: {why}")
    require_inside(path, key, roots)
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{key} = {path!r}: not readable (permission denied)")
    return read_jsonl(path) if path.endswith(".jsonl") else read_parquet(path, key)


def require_inside(path: str, key: str, roots: tuple[Path, ...]) -> None:
    """The file, links resolved, must lie under one of ``roots`` (the first, or DVC's cache).

    ``dvc.yaml`` tracks ``root`` as a dep: a link out of it would let the data change with no
    rerun. Same rule and message as the params check on the path as written.
    """
    real = Path(path).resolve()
    if any(real.is_relative_to(r.resolve()) for r in roots):
        return
    raise ConfigError(f"{key} = {path!r}: {outside_message(roots[0])} (it is a link to {real})")
