"""Each recipe option against the default, over seeds, paired by seed.

``python bench/recipe_table.py [--seeds 0 1 2] [--epochs 1] [--max-steps N] [--only NAME ...]``
needs the pipeline's data and target (`make repro`). Every option and seed plans and trains in
a scratch directory linking the workspace's inputs (``bench/pilot_projection.py``'s way), with
``train.seed`` set; the default recipe is trained at the same seeds. It prints one Markdown row
per option: the final simulated τ, the final loss and tokens/s (means over seeds), and the
paired differences against the default (option minus default at the same seed, mean with its
95% Student-t interval over seeds). An interval that excludes 0 is marked ``*``. Tokens/s
depends on the machine's load while each run trains; τ and loss do not.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pilot_projection import train
from train_throughput import LINKED, ROOT

OPTIONS = {
    "default (ce, decay, adamw, cosine)": [],
    "objective.loss=kl": ["objective.loss=kl"],
    "objective.loss=ce+kl": ["objective.loss=ce+kl"],
    "objective.position_weight=dpace": ["objective.position_weight=dpace"],
    "train.optimizer=muon": ["train.optimizer=muon"],
    "train.schedule=wsd": ["train.schedule=wsd"],
    "sliding window 64": ["drafter.layer_types=[sliding_attention]", "drafter.sliding_window=64"],
    "drafter.causal=true": ["drafter.causal=true"],
}
FIGURES = {"τ": "final_simulated_tau", "loss": "final_loss", "tokens/s": "tokens_per_s"}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
"""Student's t, 97.5th percentile, by degrees of freedom: the paired interval over seeds."""


def paired(deltas: list[float], digits: int = 3) -> str:
    """Mean difference and its 95% interval over seeds; ``*`` when it excludes 0."""
    mean = statistics.fmean(deltas)
    if len(deltas) < 2:
        return f"{mean:+,.{digits}f}"
    half = T_975[len(deltas) - 1] * statistics.stdev(deltas) / len(deltas) ** 0.5
    mark = "*" if abs(mean) > half else ""
    return f"{mean:+,.{digits}f} [{mean - half:+,.{digits}f}, {mean + half:+,.{digits}f}]{mark}"


def row(name: str, runs: list[dict], base: list[dict]) -> str:
    cells = [name]
    for key in FIGURES.values():
        digits = 0 if key == "tokens_per_s" else 3
        cells.append(f"{statistics.fmean(r[key] for r in runs):,.{digits}f}")
        deltas = [r[key] - b[key] for r, b in zip(runs, base, strict=True)]
        cells.append("" if runs is base else paired(deltas, digits))
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default: 1)")
    parser.add_argument("--max-steps", type=int, default=None, help="a pilot of N steps")
    parser.add_argument("--only", nargs="+", default=None, help="options to run, by name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not all((ROOT / rel).exists() for rel in LINKED):
        sys.exit("the pipeline's data is missing: run `make repro` first")
    common = [f"train.epochs={args.epochs}", "logging.wandb=disabled", *args.set]
    common += [f"train.checkpoint_every={10**9}"]
    common += [f"train.max_steps={args.max_steps}"] if args.max_steps else []
    names = [n for n in OPTIONS if args.only is None or n in args.only or not OPTIONS[n]]
    runs = {
        name: [train([*common, *OPTIONS[name], f"train.seed={s}"], ROOT) for s in args.seeds]
        for name in names
    }
    base = runs[next(iter(OPTIONS))]
    header = [h for f in FIGURES for h in (f, f"Δ{f}")]
    print(f"\n{len(args.seeds)} seeds {args.seeds}; {base[0]['steps']} steps a run\n")
    print("| option | " + " | ".join(header) + " |")
    print("|---" * (1 + len(header)) + "|")
    for name, result in runs.items():
        print(row(name, result, base))


if __name__ == "__main__":
    main()
