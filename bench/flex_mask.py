"""Memory and time of the FlexAttention ``BlockMask`` at a micro-batch's shape, on CPU.

The mask is built from key-tile lists (``flex_block_mask``); ``create_block_mask`` evaluated the
rule on every query-key pair instead, about 10 bytes a pair. The default shape is the recipe's
row: 8,192 tokens, 4 documents of 2,048 with 512 anchors each, block 16, so 32,768 queries over
40,960 keys. ``--pairs`` also times the pair-by-pair build, at a shape small enough to afford
(its cost grows with queries x keys). Prints one JSON line per build, then PASS/FAIL against
the budget (64 MiB, 50 ms) and exits 1 on FAIL.

    python bench/flex_mask.py [--tokens 8192] [--documents 4] [--anchors 512] [--pairs]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from dflash.model.drafter_attention import block_mask_mod, flex_block_mask

BUDGET_MIB, BUDGET_MS = 64, 50
PAIR_SHAPE = (1024, 4, 64)
"""Tokens, documents and anchors per document of the pair-by-pair build: 4K queries."""


def layout(tokens: int, documents: int, anchors: int, block_size: int):
    """One row of equal documents, each with ``anchors`` sorted random anchors."""
    length = tokens // documents
    gen = torch.Generator().manual_seed(0)
    docs = torch.arange(tokens) // length
    picks = [
        d * length + torch.randperm(length - block_size, generator=gen)[:anchors].sort().values
        for d in range(documents)
    ]
    return torch.cat(picks)[None], docs[None]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(build, anchors, docs, block_size: int, repeats: int) -> dict:
    """Extra peak memory of the first build, and the fastest of ``repeats`` builds."""
    before = peak_mib()
    build(anchors, docs, block_size, docs.shape[1])
    extra = peak_mib() - before
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        build(anchors, docs, block_size, docs.shape[1])
        times.append(time.perf_counter() - began)
    q_len = anchors.shape[1] * block_size
    return {
        "queries": q_len,
        "keys": docs.shape[1] + q_len,
        "extra_peak_mib": round(extra, 1),
        "ms": round(min(times) * 1e3, 1),
    }


def pairs(anchors, docs, block_size: int, context_len: int):
    """The pair-by-pair build."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_len = anchors.shape[1] * block_size
    return create_block_mask(
        block_mask_mod(anchors, docs, block_size, context_len),
        B=1,
        H=None,
        Q_LEN=q_len,
        KV_LEN=context_len + q_len,
        device="cpu",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=512, help="per document")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", action="store_true", help="also the pair-by-pair build")
    args = parser.parse_args()
    bs = args.block_size
    flex_block_mask(*layout(256, 2, 8, bs), bs, 256)  # warm-up: first-call allocations
    if args.pairs:
        small = layout(*PAIR_SHAPE, bs)
        print(json.dumps({"build": "pairs", **measure(pairs, *small, bs, 1)}))
    shape = layout(args.tokens, args.documents, args.anchors, bs)
    result = measure(flex_block_mask, *shape, bs, args.repeats)
    ok = result["extra_peak_mib"] <= BUDGET_MIB and result["ms"] <= BUDGET_MS
    print(json.dumps({"build": "tiles", **result, "budget": [BUDGET_MIB, BUDGET_MS]}))
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
