"""Throughput of the tokenize stage on the default chitchat corpus, and the corpus shape.

Prints conversations/s and tokens/s of template rendering + loss masks + store writing,
and the token-length distribution of whole conversations (before ``max_seq_len``), the
figures that size ``data.max_seq_len`` and the batching token budget.

    .venv/bin/python bench/tokenize_throughput.py [--max-seq-len 1024] [--chunk-size 1024]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash import paths
from dflash.data import ingest
from dflash.data.chitchat import load_chitchat
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenize import tokenize_chunks
from dflash.data.tokenizer import conversation_texts, load_tokenizer, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-loss-tokens", type=int, default=32)
    args = parser.parse_args()

    records = enumerate((record for record, _ in load_chitchat()), start=1)
    train, heldout, report = ingest.ingest(records, eval_fraction=0.0, max_conversations=None)
    print(f"chitchat: {report['records_read']} chats, {len(train)} usable conversations")
    if (paths.TOKENIZER / "tokenizer.json").exists():
        tokenizer = load_tokenizer(paths.TOKENIZER)
        print(f"tokenizer: {paths.TOKENIZER} ({len(tokenizer)} tokens)")
    else:
        start = time.perf_counter()
        tokenizer = train_tokenizer(conversation_texts(train), args.vocab_size)
        print(f"tokenizer: trained {len(tokenizer)} tokens in {time.perf_counter() - start:.1f} s")

    chunks = [train[i : i + args.chunk_size] for i in range(0, len(train), args.chunk_size)]
    with tempfile.TemporaryDirectory() as tmp:
        writer = TokenStoreWriter(Path(tmp) / "store")
        start = time.perf_counter()
        counts = tokenize_chunks(
            chunks, tokenizer, writer, args.max_seq_len, "truncate", args.min_loss_tokens
        )
        manifest = writer.close(counts)
        seconds = time.perf_counter() - start
    print(
        f"tokenize (max_seq_len {args.max_seq_len}): {len(train) / seconds:,.0f} samples/s, "
        f"{manifest['n_tokens'] / seconds:,.0f} tokens/s ({seconds:.1f} s; "
        f"{manifest['n_samples']} kept, {counts['truncated']} truncated, "
        f"{counts['dropped']['too_few_loss_tokens']} with < {args.min_loss_tokens} loss tokens)"
    )

    texts = [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in train]
    lengths = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids])
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(
        f"whole conversations: {lengths.sum():,} tokens, p50 {p50:.0f}, p90 {p90:.0f}, "
        f"p99 {p99:.0f}, max {lengths.max()}, mean {lengths.mean():.0f}; "
        f"over {args.max_seq_len}: {(lengths > args.max_seq_len).mean():.1%}"
    )


if __name__ == "__main__":
    main()
