"""GPU memory of the README recipe, on paper: Qwen3-8B target in bf16, 5-layer drafter.

``python bench/gpu_memory.py`` prints the per-component memory of one micro-batch at the
recipe's ``token_budget`` and the largest ``token_budget`` that fits 80 GB and 96 GB per GPU,
with and without recomputing the drafter layers in backward (a lever this project does not
implement yet: the column says what it would buy). The formulas are those of
``bench/memory_model.py``, which ``bench/step_memory.py`` checks against measured CPU peaks.

Rows are the recipe's packed 4,096-token rows, each holding two documents of the seeds' mean
length (about 2,000 tokens) with the recipe's 512 anchors each: 1,024 x 16 block slots per row,
4 per token. The drafter's activations scale with those slots, not with the tokens.
"""

from __future__ import annotations

import argparse

from memory_model import Batch, Dims, components

QWEN3_8B = Dims(
    vocab=151936,
    hidden=4096,
    target_layers=36,
    intermediate=12288,
    heads=32,
    kv_heads=8,
    head_dim=128,
    drafter_layers=5,
    features=5,
    block_size=16,
)
BF16 = 2
GB = 1e9
RESERVED_GB = 4.0
"""CUDA context, NCCL buffers and allocator slack that no tensor accounts for."""


def batch_of(token_budget: int, row_len: int, anchors: int) -> Batch:
    return Batch(rows=max(1, token_budget // row_len), row_len=row_len, anchors=anchors)


def total_gb(token_budget: int, args: argparse.Namespace, checkpoint_layers: bool) -> float:
    parts = components(
        QWEN3_8B,
        batch_of(token_budget, args.row_len, args.anchors),
        act_bytes=BF16,
        weight_bytes=BF16,
        checkpoint_layers=checkpoint_layers,
    )
    return sum(parts.values()) / GB + RESERVED_GB


def largest_budget(capacity_gb: float, args: argparse.Namespace, checkpoint_layers: bool) -> int:
    """Largest multiple of the row length whose step fits ``capacity_gb`` (0 if none does)."""
    rows = 0
    while total_gb((rows + 1) * args.row_len, args, checkpoint_layers) <= capacity_gb:
        rows += 1
    return rows * args.row_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--row-len", type=int, default=4096, help="tokens per (packed) row")
    parser.add_argument("--anchors", type=int, default=1024, help="anchors per row")
    args = parser.parse_args()
    batch = batch_of(args.token_budget, args.row_len, args.anchors)
    print(
        f"Qwen3-8B target (bf16), {QWEN3_8B.drafter_layers}-layer drafter, "
        f"{batch.rows} rows x {args.row_len} tokens, {args.anchors} anchors per row, "
        f"block {QWEN3_8B.block_size}\n"
    )
    plain = components(QWEN3_8B, batch, BF16, BF16)
    recomputed = components(QWEN3_8B, batch, BF16, BF16, checkpoint_layers=True)
    print("| component | GB | GB, if layers were recomputed |")
    print("|---|---|---|")
    for name in plain:
        print(f"| {name} | {plain[name] / GB:,.1f} | {recomputed[name] / GB:,.1f} |")
    print(f"| reserved (CUDA, NCCL, slack) | {RESERVED_GB:.1f} | {RESERVED_GB:.1f} |")
    print(
        f"| **total** | **{total_gb(args.token_budget, args, False):,.1f}** | "
        f"**{total_gb(args.token_budget, args, True):,.1f}** |\n"
    )
    print("| GPU | largest token_budget | if layers were recomputed |")
    print("|---|---|---|")
    for capacity in (80, 96):
        print(
            f"| {capacity} GB | {largest_budget(capacity, args, False):,} | "
            f"{largest_budget(capacity, args, True):,} |"
        )


if __name__ == "__main__":
    main()
