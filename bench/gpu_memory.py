"""GPU memory of the README recipe, on paper: bf16 targets, 5-layer drafter, DDP and FSDP.

``python bench/gpu_memory.py`` prints the per-component memory of one micro-batch of the
Qwen3-8B recipe at its ``token_budget``, then for Qwen3-8B, Qwen3-32B and Llama-3.1-70B under
``train.parallelism`` ddp and fsdp (8 GPUs) the memory per GPU and the largest
``token_budget`` that fits 80 GB and 96 GB, with and without recomputing the drafter layers
in backward (``train.recompute``), and the decoupled rows (``train.topology: decoupled``, 2
target ranks : 6 drafter ranks): a target rank holding the bf16 target whole or, under
``train.parallelism: fsdp``, 1/2 of it (sharded over the 2 target ranks), and a drafter
rank free of the target but for the borrowed embedding and head.
The formulas are those of ``bench/memory_model.py``, which ``bench/step_memory.py`` checks
against measured CPU peaks.

Rows are the recipe's packed 4,096-token rows, each holding two documents of a chat corpus's
typical mean length (about 2,000 tokens) with the recipe's 512 anchors each: 1,024 x 16 block
slots per row, 4 per token. The drafter's activations scale with those slots, not with the tokens.
``--family dflash2`` sizes a DFlash 2 drafter instead (convs of 2 taps over groups of 16
channels, a selector of ``--selector-rank`` over the whole vocabulary, ``--top-k``
candidates).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from memory_model import Batch, Dims, components, dflash2_sizes, role_components, transients

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
TARGETS = {
    "Qwen3-8B": QWEN3_8B,
    "Qwen3-32B": replace(
        QWEN3_8B, hidden=5120, target_layers=64, intermediate=25600, heads=64, kv_heads=8
    ),
    "Llama-3.1-70B": replace(
        QWEN3_8B, vocab=128256, hidden=8192, target_layers=80, intermediate=28672, heads=64
    ),
}
"""Public configs of three target sizes, each with the recipe's 5-layer, 5-feature drafter."""
GPUS = 8
BF16 = 2
GB = 1e9
RESERVED_GB = 4.0
"""CUDA context, NCCL buffers and allocator slack that no tensor accounts for."""


def batch_of(token_budget: int, row_len: int, anchors: int) -> Batch:
    return Batch(rows=max(1, token_budget // row_len), row_len=row_len, anchors=anchors)


def total_gb(
    token_budget: int, args: argparse.Namespace, checkpoint_layers: bool, dims=QWEN3_8B, shards=1
) -> float:
    parts = components(
        dims,
        batch_of(token_budget, args.row_len, args.anchors),
        act_bytes=BF16,
        weight_bytes=BF16,
        checkpoint_layers=checkpoint_layers,
        shards=shards,
        device="cuda",
        dflash2=dflash2_sizes(args),
    )
    return sum(parts.values()) / GB + RESERVED_GB


def largest_budget(
    capacity_gb: float, args: argparse.Namespace, checkpoint_layers: bool, dims=QWEN3_8B, shards=1
) -> int:
    """Largest multiple of the row length whose step fits ``capacity_gb`` (0 if none does)."""
    rows = 0
    while total_gb((rows + 1) * args.row_len, args, checkpoint_layers, dims, shards) <= capacity_gb:
        rows += 1
    return rows * args.row_len


def recipe_table(args: argparse.Namespace) -> None:
    """Qwen3-8B under DDP, component by component, with and without recomputation."""
    batch = batch_of(args.token_budget, args.row_len, args.anchors)
    print(
        f"Qwen3-8B target (bf16), {QWEN3_8B.drafter_layers}-layer drafter, "
        f"{batch.rows} rows x {args.row_len} tokens, {args.anchors} anchors per row, "
        f"block {QWEN3_8B.block_size}\n"
    )
    sizes = dflash2_sizes(args)
    plain = components(QWEN3_8B, batch, BF16, BF16, device="cuda", dflash2=sizes)
    recomputed = components(
        QWEN3_8B, batch, BF16, BF16, checkpoint_layers=True, device="cuda", dflash2=sizes
    )
    print("| component | GB | GB, if layers were recomputed |")
    print("|---|---|---|")
    for name in plain:
        print(f"| {name} | {plain[name] / GB:,.1f} | {recomputed[name] / GB:,.1f} |")
    print(f"| reserved (CUDA, NCCL, slack) | {RESERVED_GB:.1f} | {RESERVED_GB:.1f} |")
    print(
        f"| **total** | **{total_gb(args.token_budget, args, False):,.1f}** | "
        f"**{total_gb(args.token_budget, args, True):,.1f}** |\n"
    )
    named = transients(QWEN3_8B, batch, BF16, device="cuda", dflash2=sizes)
    print(
        "transients, the largest counted: "
        + ", ".join(f"{name} {size / GB:,.2f} GB" for name, size in named.items())
        + "\n"
    )


def modes_table(args: argparse.Namespace) -> None:
    """Every target under DDP and FSDP over 8 GPUs: GB per GPU, largest token_budget."""
    print(
        f"| target | mode | GB per GPU at {args.token_budget:,} | largest token_budget, 80 GB "
        "| 96 GB | 80 GB, layers recomputed | 96 GB, layers recomputed |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, dims in TARGETS.items():
        for mode, shards in (("ddp", 1), ("fsdp", GPUS)):
            gb = total_gb(args.token_budget, args, False, dims, shards)
            fits = [
                largest_budget(capacity, args, recompute, dims, shards)
                for recompute in (False, True)
                for capacity in (80, 96)
            ]
            cells = " | ".join(f"{n:,}" if n else "does not fit" for n in fits)
            print(f"| {name} | {mode} | {gb:,.1f} | {cells} |")


def role_gb(token_budget: int, args, dims: Dims, role: str, shards: int = 1) -> float:
    batch = batch_of(token_budget, args.row_len, args.anchors)
    parts = role_components(dims, batch, BF16, BF16, role, shards, "cuda", dflash2_sizes(args))
    return sum(parts.values()) / GB + RESERVED_GB


def decoupled_table(args: argparse.Namespace) -> None:
    """Per role of a decoupled run: GB per GPU at the budget, largest budget that fits."""
    print(
        f"\n| target | decoupled role | GB per GPU at {args.token_budget:,} | "
        "largest token_budget, 80 GB | 96 GB |"
    )
    print("|---|---|---|---|---|")
    for name, dims in TARGETS.items():
        roles = [
            ("target rank, whole", "target", 1),
            ("target rank, fsdp over 2", "target", 2),
            ("drafter rank, ddp", "drafter", 1),
            (f"drafter rank, fsdp over {GPUS - 2}", "drafter", GPUS - 2),
        ]
        for label, role, shards in roles:
            gb = role_gb(args.token_budget, args, dims, role, shards)
            fits = []
            for capacity in (80, 96):
                rows = 0
                while role_gb((rows + 1) * args.row_len, args, dims, role, shards) <= capacity:
                    rows += 1
                fits.append(f"{rows * args.row_len:,}" if rows else "does not fit")
            print(f"| {name} | {label} | {gb:,.1f} | {' | '.join(fits)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--row-len", type=int, default=4096, help="tokens per (packed) row")
    parser.add_argument("--anchors", type=int, default=1024, help="anchors per row")
    parser.add_argument("--family", choices=["dflash", "dflash2"], default="dflash")
    parser.add_argument("--selector-rank", type=int, default=256, help="dflash2 (z-lab's 256)")
    parser.add_argument("--top-k", type=int, default=16, help="dflash2: selector_top_k")
    args = parser.parse_args()
    recipe_table(args)
    modes_table(args)
    decoupled_table(args)


if __name__ == "__main__":
    main()
