"""The evaluate stage's outputs: ``metrics/eval.json``, the acceptance plot, and DVCLive.

``metrics/eval.json`` is the contract (DESIGN.md); DVCLive gets the same summary flattened,
per-prompt τ of each method as steps, and the per-position acceptance as a plot, so ``dvc exp
show`` and ``dvc plots diff`` compare them across experiments.
"""

from __future__ import annotations

from dflash import paths
from dflash.fileio import remove_files, write_json_atomic, write_text_atomic
from dflash.live import open_live

LIVE_SUMMARY = (
    "acceptance_length",
    "acceptance_length_pooled",
    "speedup",
    "lossless_mismatches",
    "near_tie_divergences",
    "answer_cap_fraction",
    "answer_loop_fraction",
    "heldout_loss",
)


def live_summary(metrics: dict) -> dict[str, float]:
    flat = {k: metrics[k] for k in LIVE_SUMMARY if metrics.get(k) is not None}
    for name, base in metrics.get("baselines", {}).items():
        flat[f"{name}_acceptance_length"] = base["acceptance_length"]
        flat[f"{name}_speedup"] = base["speedup"]
    for name, loss in metrics.get("heldout_loss_by_length", {}).items():
        if loss is not None:
            flat[f"heldout_loss_{name}"] = loss
    return flat


def write_eval_outputs(metrics: dict, decodes) -> None:
    """The old metrics go first and the new come last: a run killed in between leaves no old
    metrics beside new acceptance rows (they are two files in two directories)."""
    remove_files(paths.EVAL_METRICS, paths.EVAL_ACCEPTANCE)
    per = metrics["per_position_acceptance"]
    rows = "position,acceptance\n" + "".join(f"{k},{a:.6f}\n" for k, a in enumerate(per, 1))
    write_text_atomic(paths.EVAL_ACCEPTANCE, rows)
    live = open_live(paths.EVAL_LIVE)
    for i in range(len(decodes.greedy)):
        for name, outputs in decodes.methods.items():
            accepted = outputs[i].accepted
            if accepted:
                live.log_metric(f"tau/{name}", sum(accepted) / len(accepted))
        live.next_step()
    points = [{"position": k, "acceptance": a} for k, a in enumerate(per, 1)]
    live.log_plot("acceptance", points, x="position", y="acceptance", title="Acceptance")
    live.summary.update(live_summary(metrics))
    live.end()
    write_json_atomic(paths.EVAL_METRICS, metrics, sort_keys=True)
