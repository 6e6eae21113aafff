"""The comparison as one screen (at most 100 columns) or as JSON with the same figures."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash.commands.compare.paired import Pairing, Row
from dflash.commands.compare.revisions import Run
from dflash.metrics.names import BY_NAME, COMPARE, shown

WIDTH = 100
LABEL = 26
HOURS = BY_NAME["projected_hours"]
DURATIONS = ((HOURS.label, 1.0), ("projected min", 60.0), ("projected s", 3600.0))
"""(label, per hour): a projection is shown in the largest unit in which the first run's is 1 or
more, so a pilot's minutes keep their digits without scientific notation."""
FORMATS = (
    {"tau": ".2f"}
    | {m.label: m.spec for m in shown(COMPARE)}
    | {label: HOURS.spec for label, _ in DURATIONS}
)
RELATIVE = (BY_NAME["tokens_per_s"].label, *(label for label, _ in DURATIONS))
"""Figures whose difference is also shown as a share of the first group's."""
HEADER = f"  {'figure':<{LABEL}}{'n':>4}  {'first':<18}{'this':<18}{'Δ':>12}  95% interval"


def group_label(group: list[Run]) -> str:
    names = ", ".join(r.label for r in group)
    return names if len(group) == 1 else f"{names} ({len(group)} seeds pooled)"


def number(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return format(value, ("+" if signed else "") + spec)


def with_interval(value: float | None, ci: list[float] | None, spec: str) -> str:
    shown = number(value, spec)
    return shown if ci is None else f"{shown} [{number(ci[0], spec)}, {number(ci[1], spec)}]"


def readable(row: Row) -> Row:
    """``row`` with a projection in hours rescaled to the unit of :data:`DURATIONS`."""
    if row.figure != DURATIONS[0][0] or not row.first:
        return row
    label, per_hour = next((d for d in DURATIONS if row.first * d[1] >= 1), DURATIONS[-1])

    def scaled(value):
        if value is None:
            return None
        return [v * per_hour for v in value] if isinstance(value, list) else value * per_hour

    return dataclasses.replace(
        row, figure=label, first=scaled(row.first), first_ci=scaled(row.first_ci),
        this=scaled(row.this), this_ci=scaled(row.this_ci), delta=scaled(row.delta),
        ci=scaled(row.ci),
    )  # fmt: skip


def line(row: Row) -> str:
    row = readable(row)
    spec = FORMATS.get(row.figure, ".3g")
    label = f"τ {row.set} {row.stratum}" if row.figure == "tau" else row.figure
    delta = number(row.delta, spec, signed=True)
    if row.figure in RELATIVE and row.delta is not None and row.first:
        delta += f" ({row.delta / row.first:+.0%})"
    delta += "*" if row.resolved else " "
    ci = "" if row.ci is None else "[{}, {}]".format(*(number(v, spec, True) for v in row.ci))
    first = with_interval(row.first, row.first_ci, spec)
    this = with_interval(row.this, row.this_ci, spec)
    cells = f"  {label[:LABEL]:<{LABEL}}{row.n:>4}  {first:<18}{this:<18}{delta:>12}  {ci}"
    return cells.rstrip()[:WIDTH]


Comparison = tuple[list[Run], list[Row], Pairing]
"""One later group, its rows against the first group, and how their prompts paired."""


def unpaired_note(pairing: Pairing) -> str | None:
    """A line counting the prompts left out for want of a partner; None when none was."""
    if not pairing.unpaired_first and not pairing.unpaired_this:
        return None
    return (
        f"  τ: {pairing.paired} prompts paired; left out, unpaired (another prompt or no τ): "
        f"{pairing.unpaired_first} of the first's, {pairing.unpaired_this} of these"
    )


def render(first: list[Run], comparisons: list[Comparison]) -> str:
    out = [f"dflash compare: against {group_label(first)}"]
    for group, rows, pairing in comparisons:
        out += ["", f"{group_label(group)}"[:WIDTH], HEADER]
        if not any(r.figure == "tau" for r in rows):
            out.append("  τ: no prompt scored by both (other prompts: evaluate params or data)")
        note = unpaired_note(pairing)
        out += [note[:WIDTH]] if note and pairing.paired else []
        out += [line(r) for r in rows]
    out += [
        "",
        "n: prompts paired (τ) or runs a side; [ ]: 95% bootstrap interval over prompts, and",
        "over seeds where runs differing only in seeds are pooled; Δ* its interval excludes 0",
    ]
    return "\n".join(out) + "\n"


def as_json(first: list[Run], comparisons: list[Comparison]) -> dict[str, Any]:
    def names(group: list[Run]) -> list[dict]:
        return [{"name": r.name, "rev": r.rev} for r in group]

    return {
        "first": names(first),
        "comparisons": [
            {
                "this": names(group),
                "pairing": dataclasses.asdict(pairing),
                "rows": [dataclasses.asdict(r) | {"resolved": r.resolved} for r in rows],
            }
            for group, rows, pairing in comparisons
        ],
    }
