"""Benchmark the planner on a long-tailed length distribution; prints Markdown tables.

902,000 samples, lengths 16…8192 with mean ≈ 2,000 (lognormal, clipped: the spike at 8192
mimics truncation), token budget 49,152, max_seq_len 8,192, 8 ranks. Every strategy is
planned for all epochs, next to a plain-Python greedy packer over sorted lengths, as
length-sorted batching is usually written. A second table trades bucketed efficiency against
``num_buckets``.

    .venv/bin/python bench/plan_bench.py [--samples 902000] [--epochs 6]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from dataclasses import replace

import numpy as np

from dflash.batching.boundaries import boundaries_by, predicted_efficiency
from dflash.batching.choices import BOUNDARY_METHODS
from dflash.batching.cost import BY_PADDED_TOKENS, CostModel
from dflash.batching.metrics import WINDOW, epoch_metrics, overall, structure
from dflash.batching.params import PlanParams
from dflash.batching.planner import plan_epoch
from dflash.batching.registry import strategies


def longtail_lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(7.24, 0.9, n), 16, 8192).astype(np.int32)


def reference_greedy(lengths: list[int], token_budget: int, max_batch_size: int) -> list[list[int]]:
    """Length-sorted batching in plain Python: sort by length, fill batches until the budget."""
    batches, batch, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        grown = max(longest, lengths[i])
        if batch and ((len(batch) + 1) * grown > token_budget or len(batch) == max_batch_size):
            batches.append(batch)
            batch, grown = [], lengths[i]
        batch.append(i)
        longest = grown
    return [*batches, batch]


def measure(run, trace: bool = False) -> tuple[object, float, float | None]:
    """Result, seconds, and with ``trace`` the peak MiB of traced allocations (numpy included).

    Tracing slows Python-level loops a lot, so timings worth comparing are taken untraced.
    """
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    peak = None
    if trace:
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    return result, seconds, peak


def worst_window_mean(lengths_in_order: np.ndarray, window: int = WINDOW) -> float:
    """The mean length of the window of ``window`` samples in plan order furthest from the
    epoch's mean, relative to it (0.9: 10% shorter)."""
    n = lengths_in_order.size // window * window
    means = lengths_in_order[:n].reshape(-1, window).mean(axis=1)
    worst = means[np.argmax(np.abs(means - lengths_in_order.mean()))]
    return float(worst / lengths_in_order.mean())


def strategy_row(lengths: np.ndarray, params: PlanParams, epochs: int) -> dict[str, float]:
    def run():
        figures, previous, worst = [], None, 1.0
        for epoch in range(epochs):
            table = plan_epoch(lengths, params, epoch)
            epoch_figures, previous = epoch_metrics(table, lengths.size, previous, params.cost)
            figures.append(epoch_figures)
            window = worst_window_mean(table.column("length").to_numpy())
            worst = window if abs(window - 1) > abs(worst - 1) else worst
        return {**overall(figures), "worst_window_mean": worst}

    _, plan_seconds, _ = measure(lambda: [plan_epoch(lengths, params, e) for e in range(epochs)])
    summary, total_seconds, peak = measure(run, trace=True)
    by_tokens = plan_epoch(lengths, replace(params, cost=BY_PADDED_TOKENS), 0)
    summary["cost_imbalance_by_tokens"] = epoch_metrics(by_tokens, lengths.size, None, params.cost)[
        0
    ]["cost_imbalance"]
    return {**summary, "s_per_epoch": plan_seconds / epochs, "total_s": total_seconds, "peak": peak}


def fmt(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=902_000)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=49_152)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-buckets", type=int, default=6)
    parser.add_argument("--bucket-counts", default="1,2,4,6,8,12,16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--anchors", type=int, default=512, help="drafter anchors per document")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--slot-cost", type=float, default=0.5, help="a block slot, in tokens")
    args = parser.parse_args()

    lengths = longtail_lengths(args.samples, args.seed)
    base = PlanParams(
        strategy="sorted",
        token_budget=args.token_budget,
        max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size,
        world_size=args.world_size,
        seed=args.seed,
        cost=CostModel(args.anchors, args.block_size, args.slot_cost),
    )
    print(
        f"{lengths.size:,} samples, mean {lengths.mean():.0f}, max {lengths.max()}, "
        f"token_budget {args.token_budget}, max_seq_len {args.max_seq_len}, "
        f"max_batch_size {args.max_batch_size}, {args.world_size} ranks, {args.epochs} epochs; "
        f"cost: {args.anchors} anchors per document, block {args.block_size}, "
        f"slot cost {args.slot_cost}\n"
    )
    print(
        "| strategy | efficiency | rank_imbalance | cost_imbalance | dealt by tokens "
        "| frozen_batch_fraction | pair_overlap "
        "| window_ks | worst window mean / epoch's | s/epoch (plan) "
        "| all epochs + metrics, traced (s) | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    as_list = lengths.tolist()
    batches, ref_seconds, _ = measure(
        lambda: reference_greedy(as_list, args.token_budget, args.max_batch_size)
    )
    padded = sum(len(b) * max(as_list[i] for i in b) for b in batches)
    print(
        f"| reference (Python, sorted greedy, 1 epoch) | {fmt(lengths.sum() / padded)} | - | - "
        f"| - | 1 | 1 | - | - | {ref_seconds:.2f} | - | - |"
    )
    optimal = tuple(boundaries_by("optimal", lengths, args.num_buckets))
    for strategy, made_by in strategies().items():
        params = PlanParams(**{**vars(base), "strategy": strategy})
        name = strategy
        if made_by.uses_buckets:
            params = PlanParams(**{**vars(params), "boundaries": optimal})
            name = f"{strategy} (optimal, K={args.num_buckets})"
        r = strategy_row(lengths, params, args.epochs)
        print(
            f"| {name} | {fmt(r['padding_efficiency'])} | {fmt(r['rank_imbalance'])} "
            f"| {fmt(r['cost_imbalance'])} | {fmt(r['cost_imbalance_by_tokens'])} "
            f"| {fmt(r['frozen_batch_fraction'])} | {fmt(r['pair_overlap'])} "
            f"| {fmt(r['window_ks'])} | {fmt(r['worst_window_mean'], 3)} "
            f"| {r['s_per_epoch']:.2f} | {r['total_s']:.1f} "
            f"| {r['peak']:.0f} |"
        )

    print("\nbucketed: padding efficiency vs num_buckets (predicted by the cost model / planned)\n")
    heads = " | ".join(f"{m} predicted | {m} planned" for m in BOUNDARY_METHODS)
    print(f"| num_buckets | {heads} |")
    print("|---|" + "---|---|" * len(BOUNDARY_METHODS))
    for k in (int(k) for k in args.bucket_counts.split(",")):
        cells = []
        for method in BOUNDARY_METHODS:
            edges = tuple(boundaries_by(method, lengths, k))
            params = PlanParams(**{**vars(base), "strategy": "bucketed", "boundaries": edges})
            s = structure(plan_epoch(lengths, params, 0))
            cells += [predicted_efficiency(lengths, edges), s.length.sum() / s.padded.sum()]
        print(f"| {k} | " + " | ".join(fmt(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
