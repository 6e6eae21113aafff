"""The tokenize stage: conversations to a memory-mapped token store with a loss mask.

Conversations stream through in chunks of ``data.chunk_size``, so memory is bounded by one
chunk whatever the corpus size. Each sample is cut to ``data.max_seq_len`` (or dropped,
per ``data.overlength``) and dropped when it has fewer than ``2 x drafter.block_size``
loss tokens: too few for even one anchored block plus its targets. Every drop is counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from dflash import paths
from dflash.config import Config
from dflash.data.chat import encode_conversations
from dflash.data.conversations import count_conversations, iter_conversations
from dflash.data.store import TokenStore, TokenStoreWriter
from dflash.data.tokenizer import MASK_TOKEN, load_tokenizer, tokenizer_hash
from dflash.fileio import write_json_atomic

DROP_REASONS = ("overlength", "too_few_loss_tokens")


def tokenize_chunks(
    chunks: Iterable[list[dict]],
    tokenizer: PreTrainedTokenizerFast,
    writer: TokenStoreWriter,
    max_seq_len: int,
    overlength: str,
    min_loss_tokens: int,
    progress: tqdm | None = None,
) -> dict:
    """Encode and filter every chunk into ``writer``; returns the counts for the manifest."""
    counts = {"conversations_read": 0, "truncated": 0, "dropped": dict.fromkeys(DROP_REASONS, 0)}
    for chunk in chunks:
        # One token past the limit is enough to tell an overlength sample.
        messages = [row["messages"] for row in chunk]
        encoded = encode_conversations(tokenizer, messages, max_tokens=max_seq_len + 1)
        for row, (ids, mask) in zip(chunk, encoded, strict=True):
            counts["conversations_read"] += 1
            if len(ids) > max_seq_len:
                if overlength == "drop":
                    counts["dropped"]["overlength"] += 1
                    continue
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                counts["truncated"] += 1
            if np.count_nonzero(mask) < min_loss_tokens:
                counts["dropped"]["too_few_loss_tokens"] += 1
                continue
            writer.append(ids, mask, row["conversation_id"])
        if progress is not None:
            progress.update(len(chunk))
    return counts


def tokenize_file(
    source: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    out: str | Path,
    max_seq_len: int,
    overlength: str,
    min_loss_tokens: int,
    chunk_size: int,
) -> dict:
    """Tokenize a conversations Parquet file into a store at ``out``; returns its manifest."""
    writer = TokenStoreWriter(out)
    with tqdm(total=count_conversations(source), desc="tokenize", unit="conv") as progress:
        counts = tokenize_chunks(
            iter_conversations(source, chunk_size),
            tokenizer,
            writer,
            max_seq_len,
            overlength,
            min_loss_tokens,
            progress,
        )
    manifest = {
        "source": str(source),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "max_seq_len": max_seq_len,
        "overlength": overlength,
        "min_loss_tokens": min_loss_tokens,
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


def run(config: Config) -> None:
    """Tokenize ``data/regenerated/conversations.parquet`` into ``data/tokenized``."""
    tokenizer = load_tokenizer(paths.TOKENIZER)
    manifest = tokenize_file(
        paths.REGENERATED_CONVERSATIONS,
        tokenizer,
        paths.TOKENIZED,
        config.data.max_seq_len,
        config.data.overlength,
        2 * config.drafter.block_size,
        config.data.chunk_size,
    )
    store = TokenStore(paths.TOKENIZED)
    report = {**manifest, "length": length_summary(store.lengths)}
    write_json_atomic(paths.TOKENIZE_REPORT, report)
    print(
        f"tokenize: {manifest['n_samples']} samples, {manifest['n_tokens']} tokens "
        f"({manifest['n_loss_tokens']} with loss), truncated {manifest['truncated']}, "
        f"dropped {manifest['dropped']}"
    )
