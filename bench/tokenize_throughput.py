"""Throughput of the tokenize stage on the default chitchat corpus, and the corpus shape.

Prints conversations/s and tokens/s of template rendering + loss masks + store writing,
and the token-length distribution of whole conversations (before ``max_seq_len``), the
figures that size ``data.max_seq_len`` and the batching token budget.

    .venv/bin/python bench/tokenize_throughput.py [--max-seq-len 1024] [--workers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash.data import ingest
from dflash.data.chitchat import load_chitchat
from dflash.data.conversations import batch_rows, iter_batches
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenize import Policy, tokenize_chunks, worker_count
from dflash.data.tokenizer import corpus_texts, load_tokenizer, train_tokenizer
from dflash.pipeline.workspace import RELATIVE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-loss-tokens", type=int, default=32)
    parser.add_argument("--workers", type=int, default=None, help="default: all cores")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        records = enumerate((record for record, _ in load_chitchat()), start=1)
        report = ingest.ingest(
            records,
            Path(tmp) / RELATIVE.conversations.name,
            Path(tmp) / RELATIVE.heldout.name,
            eval_fraction=0.0,
            max_conversations=None,
        )
        conversations = Path(tmp) / RELATIVE.conversations.name
        n_train = report["kept"]["train"]
        print(f"chitchat: {report['records_read']} chats, {n_train} usable conversations")
        if (RELATIVE.tokenizer / "tokenizer.json").exists():
            tokenizer = load_tokenizer(RELATIVE.tokenizer)
            print(f"tokenizer: {RELATIVE.tokenizer} ({len(tokenizer)} tokens)")
        else:
            start = time.perf_counter()
            tokenizer = train_tokenizer(corpus_texts(conversations), args.vocab_size)
            seconds = time.perf_counter() - start
            print(f"tokenizer: trained {len(tokenizer)} tokens in {seconds:.1f} s")

        workers = worker_count(args.workers)
        policy = Policy(args.max_seq_len, "truncate", args.min_loss_tokens)
        writer = TokenStoreWriter(Path(tmp) / "store")
        start = time.perf_counter()
        batches = iter_batches(conversations, args.chunk_size)
        counts = tokenize_chunks(batches, tokenizer, writer, policy, workers)
        manifest = writer.close(counts)
        seconds = time.perf_counter() - start
        print(
            f"tokenize (max_seq_len {args.max_seq_len}, {workers} workers): "
            f"{n_train / seconds:,.0f} samples/s, "
            f"{manifest['n_tokens'] / seconds:,.0f} tokens/s ({seconds:.1f} s; "
            f"{manifest['n_samples']} kept, {counts['truncated']} truncated, "
            f"{counts['dropped']['too_few_loss_tokens']} with < {args.min_loss_tokens} loss tokens)"
        )
        rows = [row for batch in iter_batches(conversations, 4096) for row in batch_rows(batch)]

    texts = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in rows]
    lengths = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(
        f"whole conversations: {lengths.sum():,} tokens, p50 {p50:.0f}, p90 {p90:.0f}, "
        f"p99 {p99:.0f}, max {lengths.max()}, mean {lengths.mean():.0f}; "
        f"over {args.max_seq_len}: {(lengths > args.max_seq_len).mean():.1%}"
    )


if __name__ == "__main__":
    main()
