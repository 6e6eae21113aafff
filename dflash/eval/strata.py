"""τ per stratum of a prompt set: where a drafter that scores well overall still fails.

"High accuracy in training, low acceptance in serving" hides in averages: thinking and plain
answers, tool-calling turns and long prompts accept very differently. Each stratum gets τ per
response with its own bootstrap 95% interval, z-lab's count beside it, the n-gram baseline
on the same prompts, the prompt count and the acceptance per draft position, so a gap between
two strata can be told from noise. A stratum with no prompt is listed with ``n_prompts: 0``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dflash.config.schema import HELDOUT_SET
from dflash.eval.metrics import acceptance_by_position, bootstrap_interval, response_tau
from dflash.metrics.schema import EvalDetails, EvalSet

if TYPE_CHECKING:  # torch stays out: the report and publish read the scorecard without a model
    from dflash.eval.prompts import Prompt
    from dflash.model.generate import GenerateOutput

TERCILES = ("short", "medium", "long")
KINDS = ("mode", "tools", "length")
GROUPS = ("with", "without", *TERCILES)
"""The order rows are shown in (``metrics/eval.json`` keeps its keys sorted); modes go as given."""


def tercile_groups(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each length's tercile (0, 1, 2 for ``TERCILES``) and the two edges between them."""
    edges = np.quantile(lengths, [1 / 3, 2 / 3])
    return np.searchsorted(edges, lengths, side="right"), edges


def stratum(
    dflash: list[GenerateOutput], ngram: list[GenerateOutput], block_size: int, seed: int
) -> dict:
    """The figures of one group of prompts (``None`` where the group is empty)."""
    taus, zlab, base = (
        response_tau(dflash),
        response_tau(dflash, "agreed"),
        response_tau(ngram),
    )

    def mean(values: np.ndarray) -> float | None:
        return float(values.mean()) if len(values) else None

    return {
        "n_prompts": len(dflash),
        "acceptance_length": mean(taus),
        "acceptance_length_ci95": bootstrap_interval(taus, seed) if len(taus) else None,
        "acceptance_length_zlab": mean(zlab),
        "ngram_acceptance_length": mean(base),
        "per_position_acceptance": acceptance_by_position(dflash, block_size) if dflash else None,
    }


def groups(prompts: list[Prompt], modes: list[str]) -> dict[str, dict[str, list[int]]]:
    """Prompt indices per stratum: mode (when scored in several), tools, length tercile."""
    out: dict[str, dict[str, list[int]]] = {}
    if len(modes) > 1:
        out["mode"] = {m: [i for i, p in enumerate(prompts) if p.mode == m] for m in modes}
    out["tools"] = {
        "with": [i for i, p in enumerate(prompts) if p.tools],
        "without": [i for i, p in enumerate(prompts) if not p.tools],
    }
    tercile, _ = tercile_groups(np.array([len(p.ids) for p in prompts]))
    out["length"] = {n: np.flatnonzero(tercile == g).tolist() for g, n in enumerate(TERCILES)}
    return out


def strata(
    prompts: list[Prompt],
    modes: list[str],
    methods: dict[str, list[GenerateOutput]],
    block_size: int,
    seed: int,
) -> dict[str, dict[str, dict]]:
    """``{kind: {group: figures}}``; a length group also names its prompt lengths."""
    out: dict[str, dict[str, dict]] = {}
    for kind, by in groups(prompts, modes).items():
        out[kind] = {}
        for name, index in by.items():
            pick = [methods["dflash"][i] for i in index], [methods["ngram"][i] for i in index]
            out[kind][name] = stratum(*pick, block_size, seed)
            if kind == "length" and index:
                lengths = [len(prompts[i].ids) for i in index]
                out[kind][name]["prompt_tokens"] = [min(lengths), max(lengths)]
    return out


def scorecard_rows(metrics: EvalDetails) -> list[dict]:
    """The rows of every set of ``metrics/eval_details.json``, the held-out split (its top
    level) first."""
    sets = {HELDOUT_SET: metrics, **(metrics.sets or {})}
    return [r for name, m in sets.items() for r in rows(name, m)]


def rows(set_name: str, metrics: EvalSet) -> list[dict]:
    """Flat rows of one set (``all`` first, then every stratum) for the plot and the report."""
    every = {
        "n_prompts": metrics.n_prompts,
        "acceptance_length": metrics.acceptance_length,
        "acceptance_length_ci95": metrics.acceptance_length_ci95,
        "acceptance_length_zlab": metrics.acceptance_length_zlab,
        "ngram_acceptance_length": metrics.baselines.ngram.acceptance_length,
    }
    out = [{"set": set_name, "stratum": "all", **every}]
    table = metrics.strata or {}
    for kind in sorted(table, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        by, order = table[kind], [*(metrics.modes or []), *GROUPS]
        for n in sorted(by, key=lambda g: order.index(g) if g in order else len(order)):
            out.append({"set": set_name, "stratum": f"{kind}:{n}", **by[n].dump()})
    return out
