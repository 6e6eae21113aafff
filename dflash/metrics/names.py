"""The training metrics, one row each: every list of them is derived from :data:`TRAIN`.

A row names a figure, says what it means, and where it goes: the summary a run ends with
(``metrics/train_details.json``, its headline ``metrics/train.json``), the log's rows
(``plots/train/log.csv``, DVCLive, wandb), the per-step plot (``plots/train/steps.csv``), the
drafter's model card, ``dflash report`` and ``dflash compare``. The models of both metrics
files (:mod:`dflash.metrics.schema`) are built from the rows, so a new metric is a row here
and the line that computes it.

Only the standard library is imported: the schema module and the report start without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REQUIRED: Any = ...
"""The default of a summary figure that every run writes."""

# What adds a figure to the run's summary.
SUMMARY = "run_summary"
"""``dflash.train.observe.summary.run_summary``: what the run's state counted."""
FEATURES = "the feature source's finish()"
STABILITY = "Monitor.stability"
KEEP_BEST = "train.keep_best"
EXPORT = "the export"
PRODUCERS = (SUMMARY, FEATURES, STABILITY, KEEP_BEST, EXPORT)

# Where a figure is plotted.
ROW = "row"
"""A column of ``plots/train/log.csv``, and a scalar of DVCLive and wandb, per log row."""
SELECTOR = "selector"
"""As ``ROW``, in the rows of a drafter with a selector (``dflash2``) only."""
VALIDATION = "validation"
"""As ``ROW``, in the rows of a validation (``train.eval_every``) only."""
SERIES = "series"
"""A list in the row, logged by draft position or by length class: never a column."""
STEP = "step"
"""A column of ``plots/train/steps.csv``: every finite step, for the batch-composition plot."""

# Where a summary figure is shown.
HEADLINE = "headline"
"""``metrics/train.json``: the few figures ``dvc exp show`` compares."""
CARD = "card"
"""The model card: the run's outcome, never its timings, so the same run writes the same
card (and ``models/drafter`` keeps one hash) on the same machine."""
REPORT = "report"
"""``dflash report``'s training grid, three figures a line."""
COMPARE = "compare"
"""``dflash compare``'s run-level rows."""


@dataclass(frozen=True)
class Metric:
    name: str
    doc: str
    type: Any = None
    """Its value's type in ``metrics/train_details.json``; None: not a summary figure."""
    by: str | None = None
    """What adds it to the summary (one of :data:`PRODUCERS`)."""
    default: Any = REQUIRED
    """A summary figure with a default is a key the file holds only sometimes."""
    plots: tuple[str, ...] = ()
    shown: tuple[str, ...] = ()
    label: str = ""
    """Its short name on ``dflash report``'s and ``dflash compare``'s screens."""
    spec: str = ""
    """Its format spec there."""

    @property
    def always(self) -> bool:
        """Every run's summary holds it (one with a default only some runs write)."""
        return self.default is REQUIRED


M = Metric
SELECTOR_FIGURES = (
    ("top_k_recall", "the share of held-out draft positions whose target token is among the "
     "head's top-K candidates", "top-K recall", ".3f"),
    ("selector_accuracy", "the share of held-out draft positions where the selector, given the "
     "target's previous token, picks the target's token (teacher-forced)", "selector acc.",
     ".3f"),
    ("path_accuracy", "the share of held-out draft positions where the selector's own greedy "
     "walk drafts the target's token", "path acc.", ".3f"),
    ("top_k_oracle_tau", "τ on the held-out batch were each slot's draft the target's token "
     "whenever the head's top-K holds it (the most a selector over these candidates could "
     "accept)", "oracle τ", ".2f"),
)  # fmt: skip
"""A selector's (``dflash2``) figures on the held-out batch, as (name, meaning, label, spec):
each is a log row's, a validation's (``val_``) and the run's last (``final_``)."""
TRAIN: tuple[Metric, ...] = (
    M("step", "The global optimizer step a log row or a point ends at (from 1).",
      plots=(ROW, STEP)),
    M("epoch", "The epoch of a log row's steps (from 0).", plots=(ROW,)),
    M("loss", "The weighted mean loss of a log row's finite steps (of one step in steps.csv).",
      plots=(ROW, STEP)),
    M("accuracy", "The share of draft positions after the first that a log row's steps got "
      "right.", plots=(ROW,)),
    M("simulated_tau", "τ of the drafter on the fixed held-out batch at a log row's step "
      "(absent without one).", plots=(ROW,)),
    *(M(name, f"``dflash2``: {doc}, at a log row's step.", plots=(SELECTOR,))
      for name, doc, _, _ in SELECTOR_FIGURES),
    M("lr", "The learning rate of a log row's last step.", plots=(ROW,)),
    M("grad_norm", "The gradient norm before clipping of a log row's last step (of each step in "
      "steps.csv).", plots=(ROW, STEP)),
    M("per_position_accuracy", "A log row's accuracy at each draft position after the first.",
      plots=(SERIES,)),
    M("loss_by_length", "A log row's loss over the steps of each length class "
      "(``data/stats/buckets.json``, by the step's mean sample length).", plots=(SERIES,)),
    M("val_loss", "The loss on the held-out batch at a validation.", plots=(VALIDATION,)),
    M("val_accuracy", "The accuracy on the held-out batch at a validation.",
      plots=(VALIDATION,)),
    M("val_simulated_tau", "τ on the held-out batch at a validation (a drafter with a "
      "selector, ``dflash2``: along its greedy walk).", plots=(VALIDATION,)),
    *(M(f"val_{name}", f"``dflash2``: {doc}, at a validation.", plots=(VALIDATION,))
      for name, doc, _, _ in SELECTOR_FIGURES),
    M("final_loss", "The mean loss of the last epoch's finite steps (None: see "
      "``null_reasons``).", float | None, SUMMARY,
      shown=(HEADLINE, CARD, REPORT, COMPARE), label="final loss", spec=".3f"),
    M("final_accuracy", "The last logged row's accuracy on the training batches (None: see "
      "``null_reasons``).", float | None, SUMMARY,
      shown=(CARD, REPORT), label="accuracy", spec=".3f"),
    M("final_simulated_tau", "The last logged row's τ on the held-out batch (None: see "
      "``null_reasons``).", float | None, SUMMARY, shown=(CARD,)),
    *(M(f"final_{name}", f"``dflash2``: the last logged row's ``{name}``.", float | None,
        SUMMARY, default=None, shown=(CARD, REPORT, COMPARE), label=label, spec=spec)
      for name, _, label, spec in SELECTOR_FIGURES),
    M("steps", "Optimizer steps the run took, skipped ones included.", int, SUMMARY,
      shown=(HEADLINE, CARD, REPORT), label="steps", spec=","),
    M("best_step", "``train.keep_best``: the step of the validation with the highest "
      "``val_simulated_tau``, whose drafter was exported (absent when no validation ran).",
      int | None, KEEP_BEST, default=None, shown=(CARD,)),
    M("best_val_simulated_tau", "That validation's simulated τ on the held-out batch.",
      float | None, KEEP_BEST, default=None, shown=(CARD,)),
    M("epochs", "The epochs the run trains (``train.epochs``).", int, SUMMARY, shown=(CARD,)),
    M("tokens_per_s", "Real tokens per second: of a log row's steps; in the summary, of the "
      "steps past warm-up (every step when all were warm-up).", float, SUMMARY, plots=(ROW,),
      shown=(HEADLINE, REPORT, COMPARE), label="tokens/s", spec=",.0f"),
    M("padded_tokens_per_s", "Tokens per second with padding, over the same steps.", float,
      SUMMARY, plots=(ROW,), shown=(HEADLINE, REPORT), label="padded tok/s", spec=",.0f"),
    M("world_size", "The drafter ranks that trained.", int, SUMMARY, shown=(CARD, REPORT),
      label="world size", spec=","),
    M("padding_efficiency", "Real tokens over padded tokens.", float, SUMMARY, plots=(ROW,),
      shown=(HEADLINE, CARD, COMPARE), label="padding eff.", spec=".3f"),
    M("mean_sample_length", "The mean sample length in tokens of a log row's steps (of one "
      "step in steps.csv).", plots=(ROW, STEP)),
    M("data_wait_fraction", "The share of the step time spent waiting for the next batch.",
      float, SUMMARY, plots=(ROW,), shown=(REPORT,), label="data wait", spec=".1%"),
    M("skipped_steps", "Steps skipped for a non-finite loss or gradient norm.", int, SUMMARY,
      shown=(CARD, REPORT), label="skipped steps", spec=","),
    M("train_seconds", "Seconds the steps took, a resumed run's earlier attempts included.", float,
      SUMMARY, shown=(REPORT,), label="seconds", spec=",.0f"),
    M("loss_spikes", "Finite steps whose loss exceeds twice the median of the previous 50.",
      int, STABILITY, shown=(HEADLINE, CARD, REPORT), label="loss spikes", spec=","),
    M("grad_norm_cv", "The finite steps' gradient norms' coefficient of variation (std / mean).",
      float | None, STABILITY, shown=(HEADLINE, REPORT), label="grad-norm CV", spec=".2f"),
    M("loss_length_corr", "Spearman correlation of the finite steps' losses with their mean "
      "sample lengths.", float | None, STABILITY,
      shown=(HEADLINE, REPORT, COMPARE), label="loss~length", spec=".2f"),
    M("planned_steps", "Optimizer steps of the full run; ``steps`` is fewer in a pilot "
      "(``train.max_steps``).", int, SUMMARY, shown=(REPORT,), label="planned steps", spec=","),
    M("projected_hours", "The full run's hours on the plan's ranks: the seconds trained, plus "
      "the plan's remaining real tokens at the rate of the later half of the steps past "
      "warm-up (None when no step ran).", float | None, SUMMARY,
      shown=(REPORT, COMPARE), label="projected h", spec=".2f"),
    M("target_idle_fraction", "The share of time the target ranks sat idle (0 when "
      "colocated).", float, FEATURES, shown=(HEADLINE,)),
    M("drafter_wait_fraction", "The share of time the drafter waited on features (0 when "
      "colocated).", float, FEATURES, shown=(HEADLINE,)),
    M("target_forwards", "Target forwards the run's features took: one per micro-batch in "
      "process or on target ranks, one per document on engines, 0 from the capture stage's "
      "files.", int | None, FEATURES, default=None),
    M("restarts", "Times torchrun restarted the job after a rank failed "
      "(``train.max_restarts``), each from the last checkpoint.", int, SUMMARY, default=0),
    M("simulated_tau_cost", "The share of the training time spent measuring τ on the held-out "
      "batch.", float, SUMMARY),
    M("flex_compiles", "Graphs ``torch.compile`` built (FlexAttention only: more than 1-2 "
      "means it recompiles).", int, SUMMARY),
    M("drafter_sources", "Each drafter geometry param's value and where it came from (params, "
      "or the checkpoint ``drafter.init_from`` names, then also under ``init_from``).",
      dict[str, str] | None, SUMMARY, default=None),
    M("drafter_sha256", "The digest of the exported ``models/drafter``.", str, EXPORT),
    M("null_reasons", "Why a figure is null, by its key: no step ran, none was finite, no "
      "held-out batch (a headline's: its own figures only). Absent when every figure has a "
      "value.", dict[str, str] | None, SUMMARY, default=None, shown=(HEADLINE,)),
)  # fmt: skip
"""Every training metric, in the order the plots, the headline, the card, the report and
compare list them."""
BY_NAME = {m.name: m for m in TRAIN}


def plotted(kind: str) -> list[str]:
    """The names plotted as ``kind`` (:data:`ROW`, ...), in table order."""
    return [m.name for m in TRAIN if kind in m.plots]


def shown(where: str) -> tuple[Metric, ...]:
    """The summary figures shown ``where`` (:data:`HEADLINE`, ...), in table order."""
    return tuple(m for m in TRAIN if where in m.shown)


def written_by(producer: str) -> tuple[str, ...]:
    """The summary names ``producer`` adds."""
    return tuple(m.name for m in TRAIN if m.by == producer)


def details() -> tuple[Metric, ...]:
    """The summary figures: ``metrics/train_details.json``'s keys, sorted as the file is."""
    return tuple(sorted((m for m in TRAIN if m.by is not None), key=lambda m: m.name))


PLOT_COLUMNS = plotted(ROW)
"""The columns of ``plots/train/log.csv``."""
OPTIONAL_COLUMNS = plotted(SELECTOR) + plotted(VALIDATION)
"""A selector's and a validation's figures: columns of the log only when a row has them."""
STEP_COLUMNS = tuple(plotted(STEP))
"""The columns of ``plots/train/steps.csv``."""


class MetricTableError(ValueError):
    """A row of :data:`TRAIN` that cannot be what it says."""


def check(table: tuple[Metric, ...] = TRAIN) -> None:
    """Raise :class:`MetricTableError` for a name listed twice, a summary figure without its
    type or producer, a shown figure that is no summary figure, or a figure on a screen
    without its label and format."""
    names = [m.name for m in table]
    problems = [f"{n} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for m in table:
        if (m.by is None) != (m.type is None) or m.by not in (None, *PRODUCERS):
            problems.append(f"{m.name}: a summary figure needs a type and a producer")
        if m.by is None and m.shown:
            problems.append(f"{m.name} is shown, but no summary figure")
        if not bool(m.label) == bool({REPORT, COMPARE} & set(m.shown)) == bool(m.spec):
            problems.append(f"{m.name}: a figure on a screen has a label and a spec, no other")
    if problems:
        raise MetricTableError("dflash/metrics/names.py: " + "; ".join(problems))


check()
