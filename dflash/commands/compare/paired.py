"""Paired differences between two groups of runs, with bootstrap intervals.

Most of τ's spread is between prompts: a long, repetitive answer accepts more than a short
one under any drafter. Two runs scored on the same prompts are compared prompt by prompt, so
that spread cancels, and prompts are resampled with both runs of each prompt together. A
prompt is known by its set and the digest of its tokens, never by its place in the set: runs
whose sets hold other prompts, fewer, or the same in another order pair only what they share,
and the prompts left without a partner are counted (:class:`Pairing`).

Runs whose params differ only in their seed params (:data:`SEED_KEYS`) are replicates of one
setting. A group of replicates scores each prompt by its mean over the replicates, and the
bootstrap also resamples the replicates, so the interval holds the spread over seeds too.
A difference is *resolved* when its 95% interval excludes zero.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dflash.commands.compare.revisions import Run
from dflash.eval.strata import GROUPS, KINDS
from dflash.metrics.names import BY_NAME, COMPARE, shown

SEED_KEYS = ("train.seed", "batching.seed")
"""The params whose runs are replicates: the drafter's initialisation, anchor draws and the
order of batches. ``evaluate.seed`` changes the prompts, so it is no replicate."""
RESAMPLES = 2000
SEED = 0
TRAIN_FIGURES = tuple((m.label, m.name) for m in shown(COMPARE))
"""(label, key of ``metrics/train_details.json``) of the run-level figures compared
(:data:`dflash.metrics.names.COMPARE`)."""


def setting(run: Run) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in run.params.items() if k not in SEED_KEYS))


def same_run(runs: list[Run]) -> str | None:
    """Why ``runs`` name one run twice (the same commit), else None: a run is no replicate of
    itself."""
    seen: dict[str | None, Run] = {}
    for run in runs:
        if run.rev in seen:
            first = seen[run.rev]
            commit = "the workspace" if run.rev is None else f"commit {run.rev[:7]}"
            return f"{first.name} and {run.name} are the same run ({commit})"
        seen[run.rev] = run
    return None


def one_setting(runs: list[Run]) -> str:
    """What the runs of a single pooled group share: every param, or all but seed params."""
    params = {repr(sorted(run.params.items())) for run in runs}
    if len(params) == 1:
        return "the runs have the same params, seeds included"
    return "the runs differ only in their seeds"


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


def by_prompt(run: Run) -> dict[tuple, dict]:
    """``run``'s records by prompt identity: (set, digest of the tokens, occurrence), the last
    telling apart the same prompt twice in a set."""
    seen: Counter = Counter()
    out = {}
    for r in run.records:
        seen[r["set"], r["digest"]] += 1
        out[r["set"], r["digest"], seen[r["set"], r["digest"]]] = r
    return out


def tau_table(group: list[Run], keys: list[tuple]) -> np.ndarray:
    """``[replicate, prompt]`` τ of ``keys`` (:func:`by_prompt`)."""
    rows = []
    for run in group:
        records = by_prompt(run)
        rows.append([records[k]["tau"] for k in keys])
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


def scored(run: Run) -> list[tuple]:
    """The prompts (:func:`by_prompt`) ``run`` scored with a τ, in its order."""
    return [key for key, r in by_prompt(run).items() if r["tau"] is not None]


def paired_keys(groups: list[list[Run]]) -> list[tuple]:
    """The prompts scored with a τ by every run of ``groups``, in the first run's order."""
    keep = scored(groups[0][0])
    for run in (run for group in groups for run in group):
        mine = set(scored(run))
        keep = [k for k in keep if k in mine]
    return keep


@dataclass
class Pairing:
    """How many prompts two groups share, and how many each scored that the other lacks
    (another prompt, or one the other scored with no τ): those are left out of every τ row."""

    paired: int
    unpaired_first: int
    unpaired_this: int


def pairing(first: list[Run], this: list[Run], keys: list[tuple]) -> Pairing:
    shared = set(keys)

    def unpaired(group: list[Run]) -> int:
        return len({k for run in group for k in scored(run)} - shared)

    return Pairing(len(keys), unpaired(first), unpaired(this))


def strata_of(run: Run, keys: list[tuple]) -> dict[tuple[str, str], list[int]]:
    """Positions in ``keys`` per (set, stratum) as the first run labels them, in the
    scorecard's order: ``all`` first, then by kind and group (:mod:`dflash.eval.strata`)."""
    labels = {key: r["strata"] for key, r in by_prompt(run).items()}
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
        va, vb = figures(first, key), figures(this, key)
        if not va and not vb and not BY_NAME[key].always:
            continue  # a figure only some drafters have (a selector's), on neither side
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


def figures(group: list[Run], key: str) -> list[float]:
    """The finite values of ``key`` among the group's training figures (a null, a NaN an
    older run wrote, or a string is none)."""
    values = [run.train.get(key) for run in group]
    return [v for v in values if type(v) in (int, float) and math.isfinite(v)]


def compare(first: list[Run], this: list[Run]) -> tuple[list[Row], Pairing]:
    """Every row of one comparison (τ per set and stratum, then the training figures), and
    how its prompts paired."""
    rows = tau_rows(first, this) + train_rows(first, this)
    return rows, pairing(first, this, paired_keys([first, this]))
