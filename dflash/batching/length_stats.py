"""Length statistics, bucket boundaries by three methods, and a plot (the stats stage).

For each boundary method ``buckets.json`` holds the edges, the efficiency its cost model
predicts (every sample padded to its bucket's upper edge) and the efficiency measured by
planning one ``bucketed`` epoch with them, so the choice is visible before any training.
"""

from __future__ import annotations

import argparse
import csv
import logging
import sys
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from dflash.batching.boundaries import boundaries_by, predicted_efficiency
from dflash.batching.choices import BOUNDARY_METHODS
from dflash.batching.errors import BatchingError
from dflash.batching.lengths import check_lengths, read_lengths
from dflash.batching.metrics import structure
from dflash.batching.params import PlanParams
from dflash.batching.planner import plan_epoch
from dflash.batching.stats_files import BUCKETS, HISTOGRAM, LENGTHS, PLOT
from dflash.config.params import at_least
from dflash.fileio import atomic_dir, require_only, write_json_atomic

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

logger = logging.getLogger(__name__)

QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
HISTOGRAM_BINS = 64


def describe(lengths: np.ndarray) -> dict[str, Any]:
    """Count, total, moments, quantiles, a histogram and the token share of each decile."""
    ordered = np.sort(lengths).astype(np.int64)
    total = int(ordered.sum())
    counts, edges = _histogram(ordered)
    return {
        "count": int(ordered.size),
        "total_tokens": total,
        "min": int(ordered[0]),
        "mean": float(ordered.mean()),
        "std": float(ordered.std()),
        "max": int(ordered[-1]),
        "quantiles": {f"p{round(q * 100):02d}": float(np.quantile(ordered, q)) for q in QUANTILES},
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "token_mass_by_decile": [float(part.sum() / total) for part in np.array_split(ordered, 10)],
    }


def _histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    edges = np.unique(np.linspace(0, int(lengths.max()), HISTOGRAM_BINS + 1).round().astype(int))
    counts, _ = np.histogram(lengths, bins=edges)
    return counts, edges


def bucket_report(lengths: np.ndarray, num_buckets: int, params: PlanParams) -> dict[str, Any]:
    """Edges, predicted and simulated efficiency for every method.

    The simulation plans epoch 0 for one rank without gradient accumulation: padding does not
    depend on how micro-batches are dealt, and a tiny dataset cannot fail for want of ranks.
    """
    report = {}
    for method in BOUNDARY_METHODS:
        edges = boundaries_by(method, lengths, num_buckets)
        simulated = PlanParams(
            strategy="bucketed",
            token_budget=params.token_budget,
            max_seq_len=params.max_seq_len,
            max_batch_size=params.max_batch_size,
            seed=params.seed,
            boundaries=tuple(edges),
        )
        s = structure(plan_epoch(lengths, simulated, epoch=0))
        report[method] = {
            "boundaries": edges,
            "predicted_efficiency": predicted_efficiency(lengths, edges),
            "simulated_efficiency": float(s.length.sum(dtype=np.int64) / s.padded.sum()),
        }
    return report


def plot_lengths(lengths: np.ndarray, report: dict[str, Any], path: Path) -> None:
    """The length histogram once per method, with that method's bucket edges."""
    fig, axes = plt.subplots(len(report), 1, figsize=(9, 2.6 * len(report)), sharex=True)
    for ax, (method, entry) in zip(np.atleast_1d(axes), report.items(), strict=True):
        ax.hist(lengths, bins=128, color="0.6")
        for edge in entry["boundaries"]:
            ax.axvline(edge, color="tab:red", linewidth=1)
        ax.set_title(
            f"{method}: predicted {entry['predicted_efficiency']:.3f}, "
            f"simulated {entry['simulated_efficiency']:.3f}",
            fontsize=10,
        )
        ax.set_ylabel("samples")
    np.atleast_1d(axes)[-1].set_xlabel("tokens per sample")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_stats(
    lengths: np.ndarray, num_buckets: int, params: PlanParams, out_dir: str | Path
) -> dict[str, Any]:
    """``lengths.json``, ``buckets.json``, ``histogram.csv`` and ``lengths.png`` in ``out_dir``."""
    if num_buckets < 1:
        raise BatchingError(f"num_buckets = {num_buckets}: must be >= 1")
    check_lengths(lengths, params.max_seq_len, params.token_budget)
    require_only(out_dir, [LENGTHS, BUCKETS, HISTOGRAM, PLOT])
    summary = describe(lengths)
    report = bucket_report(lengths, num_buckets, params)
    with atomic_dir(out_dir) as tmp:
        write_json_atomic(tmp / LENGTHS, summary)
        write_json_atomic(tmp / BUCKETS, report)
        with open(tmp / HISTOGRAM, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["length", "count"])
            edges, counts = summary["histogram"]["edges"], summary["histogram"]["counts"]
            writer.writerows(zip(edges[:-1], counts, strict=True))
        plot_lengths(lengths, report, tmp / PLOT)
    return report


def headline(report: dict[str, Any]) -> str:
    return ", ".join(
        f"{m}: {e['predicted_efficiency']:.3f} predicted / {e['simulated_efficiency']:.3f} planned"
        for m, e in report.items()
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash.batching.length_stats --lengths L.parquet --num-buckets K
    --token-budget N --out DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash.batching.length_stats", description=__doc__
    )
    parser.add_argument("--lengths", required=True, help="Parquet file with a 'length' column")
    parser.add_argument("--num-buckets", type=at_least(1), required=True)
    parser.add_argument("--token-budget", type=at_least(1), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-seq-len", type=at_least(1), help="default: the longest sample")
    parser.add_argument("--max-batch-size", type=at_least(1), default=64)
    parser.add_argument("--seed", type=at_least(0), default=0)
    args = parser.parse_args(argv)
    try:
        lengths = read_lengths(args.lengths)
        params = PlanParams(
            strategy="bucketed",
            token_budget=args.token_budget,
            max_seq_len=args.max_seq_len or int(lengths.max()),
            max_batch_size=args.max_batch_size,
            seed=args.seed,
        )
        report = write_stats(lengths, args.num_buckets, params, args.out)
    except (ValueError, OSError) as err:
        print(f"dflash.batching.length_stats: {err}", file=sys.stderr)
        return 2
    print(headline(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
