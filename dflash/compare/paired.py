"""Paired differences between two groups of runs, with bootstrap intervals.

Most of τ's spread is between prompts: a long, repetitive answer accepts more than a short
one under any drafter. Two runs scored on the same prompts are compared prompt by prompt, so
that spread cancels, and prompts are resampled with both runs of each prompt together.

Runs whose params differ only in their seed params (:data:`SEED_KEYS`) are replicates of one
setting. A group of replicates scores each prompt by its mean over the replicates, and the
bootstrap also resamples the replicates, so the interval holds the spread over seeds too.
A difference is *resolved* when its 95% interval excludes zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.compare.revisions import Run
from dflash.eval.strata import GROUPS, KINDS

SEED_KEYS = ("train.seed", "batching.seed")
"""The params whose runs are replicates: the drafter's initialisation, anchor draws and the
order of batches. ``evaluate.seed`` changes the prompts, so it is no replicate."""
RESAMPLES = 2000
SEED = 0
TRAIN_FIGURES = (
    ("tokens/s", "tokens_per_s"),
    ("padding eff.", "padding_efficiency"),
    ("final loss", "final_loss"),
    ("projected h", "projected_hours"),
    ("loss~length", "loss_length_corr"),
)
"""(label, key of ``metrics/train_details.json``) of the run-level figures compared."""


def setting(run: Run) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in run.params.items() if k not in SEED_KEYS))


def pool(runs: list[Run]) -> list[list[Run]]:
    """Runs grouped by their params but for :data:`SEED_KEYS`, in the order first named."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(setting(run), []).append(run)
    return list(groups.values())


@dataclass
class Row:
    figure: str
    set: str | None
    stratum: str | None
    n: int
    """Prompts paired (τ), or the replicates on each side (training figures: the fewer)."""
    first: float | None
    first_ci: list[float] | None
    this: float | None
    this_ci: list[float] | None
    delta: float | None
    ci: list[float] | None

    @property
    def resolved(self) -> bool:
        return self.ci is not None and (self.ci[0] > 0 or self.ci[1] < 0)


def interval(draws: np.ndarray) -> list[float]:
    return [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]


def tau_table(group: list[Run], keys: list[tuple]) -> np.ndarray:
    """``[replicate, prompt]`` τ of ``keys`` (set, prompt, digest)."""
    rows = []
    for run in group:
        by_key = {(r["set"], r["prompt"], r["digest"]): r["tau"] for r in run.records}
        rows.append([by_key[k] for k in keys])
    return np.array(rows, dtype=float)


def bootstrap_means(table: np.ndarray, picks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The mean τ of each resample: replicates drawn with replacement, then ``picks``."""
    replicates = rng.integers(0, table.shape[0], size=(len(picks), table.shape[0]))
    per_prompt = table[replicates].mean(axis=1)
    return np.take_along_axis(per_prompt, picks, axis=1).mean(axis=1)


def paired_tau(first: np.ndarray, this: np.ndarray) -> tuple[list, list, list]:
    """Bootstrap intervals of each group's mean τ and of their paired difference."""
    rng = np.random.default_rng(SEED)
    picks = rng.integers(0, first.shape[1], size=(RESAMPLES, first.shape[1]))
    a, b = bootstrap_means(first, picks, rng), bootstrap_means(this, picks, rng)
    own_a = bootstrap_means(first, rng.integers(0, first.shape[1], picks.shape), rng)
    own_b = bootstrap_means(this, rng.integers(0, first.shape[1], picks.shape), rng)
    return interval(own_a), interval(own_b), interval(b - a)


def paired_keys(groups: list[list[Run]]) -> list[tuple]:
    """(set, prompt, digest) scored with a τ by every run of ``groups``, in the first's order."""
    first = groups[0][0].records
    keep = [(r["set"], r["prompt"], r["digest"]) for r in first]
    for run in (run for group in groups for run in group):
        scored = {(r["set"], r["prompt"], r["digest"]) for r in run.records if r["tau"] is not None}
        keep = [k for k in keep if k in scored]
    return keep


def strata_of(run: Run, keys: list[tuple]) -> dict[tuple[str, str], list[int]]:
    """Positions in ``keys`` per (set, stratum) as the first run labels them, in the
    scorecard's order: ``all`` first, then by kind and group (:mod:`dflash.eval.strata`)."""
    labels = {(r["set"], r["prompt"], r["digest"]): r["strata"] for r in run.records}
    out: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(keys):
        for stratum in ["all", *labels[key]]:
            out.setdefault((key[0], stratum), []).append(i)
    sets = list(dict.fromkeys(key[0] for key in keys))
    return dict(sorted(out.items(), key=lambda item: (sets.index(item[0][0]), order(item[0][1]))))


def order(stratum: str) -> tuple[int, int, str]:
    kind, _, group = stratum.partition(":")
    if stratum == "all":
        return (-1, 0, "")
    known = KINDS.index(kind) if kind in KINDS else len(KINDS)
    return (known, GROUPS.index(group) if group in GROUPS else len(GROUPS), group)


def tau_rows(first: list[Run], this: list[Run]) -> list[Row]:
    keys = paired_keys([first, this])
    a, b = tau_table(first, keys), tau_table(this, keys)
    rows = []
    for (set_name, stratum), index in strata_of(first[0], keys).items():
        sa, sb = a[:, index], b[:, index]
        ci_a, ci_b, ci = paired_tau(sa, sb)
        ma, mb = float(sa.mean()), float(sb.mean())
        rows.append(Row("tau", set_name, stratum, len(index), ma, ci_a, mb, ci_b, mb - ma, ci))
    return rows


def train_rows(first: list[Run], this: list[Run]) -> list[Row]:
    """Run-level differences; an interval (over replicates) only with two or more a side."""
    rows = []
    for label, key in TRAIN_FIGURES:
        va = [r.train.get(key) for r in first if isinstance(r.train.get(key), int | float)]
        vb = [r.train.get(key) for r in this if isinstance(r.train.get(key), int | float)]
        ma = float(np.mean(va)) if va else None
        mb = float(np.mean(vb)) if vb else None
        delta = mb - ma if ma is not None and mb is not None else None
        ci = None
        if len(va) > 1 and len(vb) > 1:
            rng = np.random.default_rng(SEED)
            draw_a = np.array(va)[rng.integers(0, len(va), (RESAMPLES, len(va)))].mean(axis=1)
            draw_b = np.array(vb)[rng.integers(0, len(vb), (RESAMPLES, len(vb)))].mean(axis=1)
            ci = interval(draw_b - draw_a)
        rows.append(Row(label, None, None, min(len(va), len(vb)), ma, None, mb, None, delta, ci))
    return rows


def compare(first: list[Run], this: list[Run]) -> list[Row]:
    """Every row of one comparison: τ per set and stratum, then the training figures."""
    return tau_rows(first, this) + train_rows(first, this)
