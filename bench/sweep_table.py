"""Mean ± std per batching strategy over seeded DVC experiments (see ``bench/sweep.sh``).

Reads ``dvc exp show --json`` (from ``--json FILE``, or runs it) and prints one Markdown row
per strategy, in the registry's order: padding efficiency, train tokens/s, loss spikes,
grad-norm CV, held-out drafter loss per length tercile, τ and the n-gram baseline's τ. A run
is one (strategy, batching seed, train seed); an experiment wins over a commit or the workspace
with the same params.

    python bench/sweep_table.py [--json sweep.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import numpy as np

from dflash.batching.choices import strategy_names

COLUMNS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("padding eff.", "metrics/train.json", ("padding_efficiency",), ".3f"),
    ("tokens/s", "metrics/train.json", ("tokens_per_s",), ",.0f"),
    ("spikes", "metrics/train.json", ("loss_spikes",), ".1f"),
    ("grad-norm CV", "metrics/train.json", ("grad_norm_cv",), ".2f"),
    ("loss short", "metrics/eval.json", ("heldout_loss_by_length", "short"), ".3f"),
    ("loss medium", "metrics/eval.json", ("heldout_loss_by_length", "medium"), ".3f"),
    ("loss long", "metrics/eval.json", ("heldout_loss_by_length", "long"), ".3f"),
    ("τ", "metrics/eval.json", ("acceptance_length",), ".2f"),
    ("n-gram τ", "metrics/eval.json", ("baselines", "ngram", "acceptance_length"), ".2f"),
]
"""(header, metrics file, key path inside it, format) of each column."""


def runs(entries: list[dict]) -> list[dict]:
    """Every finished run in ``dvc exp show --json`` as ``{"params": ..., "metrics": {...}}``.

    A queued, running or failed experiment is left out: DVC shows it with its own params but
    the metrics of the commit it started from.
    """
    found: list[tuple[bool, dict]] = []

    def visit(entry: dict, is_experiment: bool) -> None:
        data = entry.get("data") or {}
        params = ((data.get("params") or {}).get("params.yaml") or {}).get("data")
        metrics = {k: (v or {}).get("data") or {} for k, v in (data.get("metrics") or {}).items()}
        if params and metrics:
            found.append((is_experiment, {"params": params, "metrics": metrics}))
        for group in entry.get("experiments") or []:
            if (group.get("executor") or {}).get("state", "success") != "success":
                continue
            for rev in group.get("revs") or [group]:
                visit(rev, True)

    for entry in entries:
        visit(entry, False)
    best: dict[tuple, dict] = {}
    for _, run in sorted(found, key=lambda item: item[0]):
        p = run["params"]
        key = (p["batching"]["strategy"], p["batching"]["seed"], p["train"]["seed"])
        best[key] = run  # experiments come last and replace a commit with the same params
    return list(best.values())


def dig(data: Any, path: tuple[str, ...]) -> float | None:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return float(data) if isinstance(data, int | float) and not isinstance(data, bool) else None


def cell(values: list[float], spec: str) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(np.mean(values), spec)} ± {format(np.std(values, ddof=1), spec)}"


def table(all_runs: list[dict]) -> str:
    header = ["strategy", "runs", *(c[0] for c in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    seen = {r["params"]["batching"]["strategy"] for r in all_runs}
    for strategy in [*strategy_names(), *sorted(seen - set(strategy_names()))]:
        group = [r for r in all_runs if r["params"]["batching"]["strategy"] == strategy]
        if not group:
            continue
        cells = [strategy, str(len(group))]
        for _, file, path, spec in COLUMNS:
            values = [dig(r["metrics"].get(file), path) for r in group]
            cells.append(cell([v for v in values if v is not None], spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="saved `dvc exp show --json` output (default: run it)")
    args = parser.parse_args(argv)
    if args.json:
        with open(args.json) as f:
            entries = json.load(f)
    else:
        shown = subprocess.run(
            ["dvc", "exp", "show", "--json"], capture_output=True, text=True, check=True
        )
        entries = json.loads(shown.stdout)
    found = runs(entries)
    if not found:
        print("no run with params and metrics in `dvc exp show`", file=sys.stderr)
        return 1
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
