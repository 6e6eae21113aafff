"""Tokenizing: conversations to a memory-mapped token store with a loss mask.

Conversations stream through in chunks of ``data.chunk_size``, encoded by
``data.num_workers`` processes and written in input order, so memory is bounded by a few
chunks whatever the corpus size and the store is byte-identical for any worker count. Each
conversation becomes samples per ``data.turns`` (see :mod:`dflash.data.chat`), rendered with
``data.chat_template_kwargs``; one whose text holds special-token strings is dropped,
escaped or kept per ``data.special_tokens_in_content`` (:mod:`dflash.data.specials`). Each
sample is cut to ``data.max_seq_len`` (or dropped, per ``data.overlength``) and dropped when
it has fewer than ``2 x drafter.block_size`` loss tokens: too few for even one anchored
block plus its targets.
Every drop, and every assistant turn the template does not let us map, is counted; a run
that keeps no sample fails with the report.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerFast

from dflash.data.chat import SKIP_REASONS, encode_chats
from dflash.data.conversations import batch_rows, count_conversations, iter_batches
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenizer import tokenizer_hash
from dflash.progress import progress_bar

DROP_REASONS = ("overlength", "too_few_loss_tokens")
CHUNKS_IN_FLIGHT = 2
"""Chunks queued per worker: enough to keep every worker busy, few enough to bound memory."""


@dataclass(frozen=True)
class Policy:
    """What decides which samples are kept and how they are cut."""

    max_seq_len: int
    overlength: str
    min_loss_tokens: int
    turns: str = "auto"
    chat_template_kwargs: dict = field(default_factory=dict)
    special_tokens_in_content: str = "drop"


@dataclass
class Encoded:
    """One chunk's kept samples back to back, and what happened to the rest."""

    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    n_loss: np.ndarray
    ids: list[str]
    read: int
    truncated: int
    dropped: dict[str, int]
    turns: dict[str, int] = field(default_factory=dict)
    """Assistant turns ``learned`` and left out, per reason of :data:`SKIP_REASONS`."""
    special_tokens_in_content: int = 0
    """Conversations whose text holds special-token strings."""


def encode_chunk(
    batch: pa.RecordBatch, tokenizer: PreTrainedTokenizerFast, policy: Policy
) -> Encoded:
    """Encode, cut and filter one chunk of conversations."""
    rows = batch_rows(batch)
    # One token past the limit is enough to tell an overlength sample.
    encoded = encode_chats(
        tokenizer,
        rows,
        policy.turns,
        policy.chat_template_kwargs,
        policy.max_seq_len + 1,
        policy.special_tokens_in_content,
    )
    kept: list[tuple[np.ndarray, np.ndarray, str]] = []
    truncated, dropped = 0, dict.fromkeys(DROP_REASONS, 0)
    turns = dict.fromkeys(("learned", *SKIP_REASONS), 0)
    samples, held = [], 0
    for row, (chat_samples, plan) in zip(rows, encoded, strict=True):
        held += plan.special_tokens_in_content
        turns["learned"] += plan.learned
        for _, reason in plan.skipped:
            turns[reason] += 1
        samples.extend((row, ids, mask) for ids, mask in chat_samples)
    for row, ids, mask in samples:
        if len(ids) > policy.max_seq_len:
            if policy.overlength == "drop":
                dropped["overlength"] += 1
                continue
            ids, mask = ids[: policy.max_seq_len], mask[: policy.max_seq_len]
            truncated += 1
        if np.count_nonzero(mask) < policy.min_loss_tokens:
            dropped["too_few_loss_tokens"] += 1
            continue
        kept.append((ids, mask, row["conversation_id"]))
    return Encoded(
        tokens=np.concatenate([k[0] for k in kept] or [np.zeros(0, np.uint32)]),
        mask=np.concatenate([k[1] for k in kept] or [np.zeros(0, np.uint8)]),
        lengths=np.asarray([len(k[0]) for k in kept], dtype=np.int64),
        n_loss=np.asarray([np.count_nonzero(k[1]) for k in kept], dtype=np.int64),
        ids=[k[2] for k in kept],
        read=len(rows),
        truncated=truncated,
        dropped=dropped,
        turns=turns,
        special_tokens_in_content=held,
    )


_worker_tokenizer: PreTrainedTokenizerFast | None = None
PARALLELISM = "TOKENIZERS_PARALLELISM"


def _start_worker(tokenizer: PreTrainedTokenizerFast) -> None:
    """Ctrl-C reaches the whole process group: the parent alone handles it and stops the
    pool, so a worker prints no traceback of its own."""
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ[PARALLELISM] = "false"
    _worker_tokenizer = tokenizer


@contextmanager
def _single_threaded_tokenizer() -> Iterator[None]:
    before = os.environ.get(PARALLELISM)
    os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PARALLELISM]
        else:
            os.environ[PARALLELISM] = before


def _encode_in_worker(batch: pa.RecordBatch, policy: Policy) -> Encoded:
    return encode_chunk(batch, _worker_tokenizer, policy)


def encode_chunks(
    batches: Iterable[pa.RecordBatch],
    tokenizer: PreTrainedTokenizerFast,
    policy: Policy,
    num_workers: int,
) -> Iterator[Encoded]:
    """:func:`encode_chunk` of every batch, in input order, on ``num_workers`` processes.

    One worker encodes in this process. More are started, each with the tokenizer, and at
    most ``CHUNKS_IN_FLIGHT`` chunks per worker wait, so memory does not grow with the input.
    Either way a worker is one core: the tokenizer's own threads are off, so that
    ``data.num_workers`` is the number of cores the stage uses.
    """
    if num_workers <= 1:
        with _single_threaded_tokenizer():
            for batch in batches:
                yield encode_chunk(batch, tokenizer, policy)
        return
    # Fork: workers start at once, with no re-import and no pickled tokenizer. Arrow and the
    # tokenizers library reset their thread pools in a forked child; a spawn-like start
    # would cost seconds per worker and re-run the caller's main module.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer,)
    ) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch, policy))
            if len(pending) >= CHUNKS_IN_FLIGHT * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def tokenize_chunks(
    batches: Iterable[pa.RecordBatch],
    tokenizer: PreTrainedTokenizerFast,
    writer: TokenStoreWriter,
    policy: Policy,
    num_workers: int = 1,
    progress=None,
) -> dict:
    """Encode and filter every chunk into ``writer``; returns the counts for the manifest."""
    counts = {
        "conversations_read": 0,
        "turns": policy.turns,
        "assistant_turns": dict.fromkeys(("learned", *SKIP_REASONS), 0),
        "special_tokens_in_content": {
            "policy": policy.special_tokens_in_content,
            "conversations": 0,
        },
        "truncated": 0,
        "dropped": dict.fromkeys(DROP_REASONS, 0),
    }
    for chunk in encode_chunks(batches, tokenizer, policy, num_workers):
        writer.extend(chunk.tokens, chunk.mask, chunk.lengths, chunk.n_loss, chunk.ids)
        counts["conversations_read"] += chunk.read
        counts["truncated"] += chunk.truncated
        counts["special_tokens_in_content"]["conversations"] += chunk.special_tokens_in_content
        for reason, n in chunk.dropped.items():
            counts["dropped"][reason] += n
        for reason, n in chunk.turns.items():
            counts["assistant_turns"][reason] += n
        if progress is not None:
            progress.update(chunk.read)
    return counts


def tokenize_file(
    source: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    out: str | Path,
    policy: Policy,
    chunk_size: int,
    num_workers: int,
) -> dict:
    """Tokenize a conversations Parquet file into a store at ``out``; returns its manifest."""
    writer = TokenStoreWriter(out)
    total = count_conversations(source)
    with progress_bar(total=total, desc="tokenize", unit="conv") as progress:
        counts = tokenize_chunks(
            iter_batches(source, chunk_size), tokenizer, writer, policy, num_workers, progress
        )
    manifest = {
        "source": str(source),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_seq_len": policy.max_seq_len,
        "overlength": policy.overlength,
        "min_loss_tokens": policy.min_loss_tokens,
        "chat_template_kwargs": policy.chat_template_kwargs,
        **counts,
    }
    return writer.close(manifest)


def length_summary(lengths: np.ndarray) -> dict:
    """Quantiles of tokens per sample, the numbers batching and ``max_seq_len`` depend on."""
    if len(lengths) == 0:
        return {}
    q = np.percentile(lengths, [50, 90, 99]).tolist()
    return {
        "mean": float(lengths.mean()),
        "p50": q[0],
        "p90": q[1],
        "p99": q[2],
        "max": int(lengths.max()),
    }


def worker_count(configured: int | None) -> int:
    """``data.num_workers``, or every core this process may run on when it is null."""
    return configured if configured is not None else len(os.sched_getaffinity(0))


class NoSamplesError(RuntimeError):
    """No conversation gave a sample to train on; ``report`` says why."""

    def __init__(self, report: dict) -> None:
        super().__init__("no training samples")
        self.report = report
