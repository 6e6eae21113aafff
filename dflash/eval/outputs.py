"""What the evaluate stage writes of its metrics: the headline, the strata plot, DVCLive's summary.

``metrics/eval_details.json`` holds every figure and ``metrics/eval.json`` the headline that
``dvc exp show`` compares (the contracts in docs/design.md). DVCLive gets per-prompt τ of each
method as steps and the per-position acceptance as a plot, for ``dvc plots``; its summary is
an output, not a metrics file, so it adds no column to ``dvc exp show``.
"""

from __future__ import annotations

from dflash.eval.strata import scorecard_rows
from dflash.metrics.headline import EVAL, headline
from dflash.metrics.schema import EvalDetails, EvalHeadline

LIVE_SUMMARY = (
    "acceptance_length",
    "acceptance_length_zlab",
    "acceptance_length_pooled",
    "speedup",
    "lossless_mismatches",
    "near_tie_divergences",
    "answer_cap_fraction",
    "answer_loop_fraction",
    "heldout_loss",
)


def live_summary(details: EvalDetails) -> dict[str, float]:
    shown = {k: getattr(details, k) for k in LIVE_SUMMARY}
    flat = {k: v for k, v in shown.items() if v is not None}
    for name, base in details.baselines:
        flat[f"{name}_acceptance_length"] = base.acceptance_length
        if base.speedup is not None:
            flat[f"{name}_speedup"] = base.speedup
    for name, loss in details.heldout_loss_by_length or ():
        if loss is not None:
            flat[f"heldout_loss_{name}"] = loss
    for name, scored in details.sets.items():
        flat[f"{name}_acceptance_length"] = scored.acceptance_length
        flat[f"{name}_ngram_acceptance_length"] = scored.baselines.ngram.acceptance_length
    return flat


def strata_csv(metrics: EvalDetails) -> str:
    """Every set's rows, the held-out split first: one bar each in ``dvc plots``."""
    lines = ["label,set,stratum,acceptance_length,ci_low,ci_high,ngram_acceptance_length,n_prompts"]
    for r in scorecard_rows(metrics):
        ci = r["acceptance_length_ci95"] or [None, None]
        cells = [r["acceptance_length"], *ci, r["ngram_acceptance_length"]]
        shown = ["" if v is None else f"{v:.6f}" for v in cells]
        lines.append(",".join([f"{r['set']} {r['stratum']}", r["set"], r["stratum"], *shown,
                               str(r["n_prompts"])]))  # fmt: skip
    return "\n".join(lines) + "\n"


def eval_headline(details: EvalDetails) -> EvalHeadline:
    """The headline, with τ's interval also as two numbers: DVC shows no list."""
    out = headline(details.dump(), EVAL)
    ci = details.acceptance_length_ci95
    if len(ci) == 2:
        out |= {"acceptance_length_ci95_low": ci[0], "acceptance_length_ci95_high": ci[1]}
    return EvalHeadline.model_validate(out)
