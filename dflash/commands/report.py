"""``dflash report``: one screen of what the pipeline did, read back from the stages' JSON files.

Every stage already writes its figures; this gathers the ones a user checks first (what was
dropped, padding, loss, acceptance, losslessness) so ``make repro`` ends with a summary. It reads
whatever exists and never raises: a stage without output says how to run it. Each file is
read as its model (:mod:`dflash.metrics.schema`); a partial file shows what it holds, and one
cut short or holding a value of the wrong type is also a warning.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, TypeVar

from dflash.batching.errors import BatchingError
from dflash.batching.io import PLAN_SUMMARY as PLAN_SUMMARY_FILE
from dflash.batching.registry import strategy
from dflash.config.schema import HELDOUT_SET, Config
from dflash.data.conversations import read_conversations
from dflash.data.store import STORE_MANIFEST
from dflash.eval.loops import text_ends_in_loop
from dflash.eval.strata import scorecard_rows
from dflash.metrics import schema as ms
from dflash.metrics.names import BY_NAME, REPORT, shown
from dflash.pipeline.freshness import stale_drafter
from dflash.pipeline.workspace import RELATIVE, Workspace

PLAN_SUMMARY = RELATIVE.plans / PLAN_SUMMARY_FILE
M = TypeVar("M", bound=ms.Metrics)


def read(root: Path, model: type[M], *rels: Path) -> M | str:
    """The file at the first existing path as ``model``, else why not ("" when none exists)."""
    for rel in rels:
        path = root / rel
        if not path.exists():
            continue
        got = ms.read(model, path)
        return got if isinstance(got, ms.Metrics) else f"unreadable {rel}: {got}"
    return ""


def num(value: Any, spec: str = ",") -> str:
    """``value`` formatted by ``spec``, or ``n/a`` when a partial file lacks it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a"
    return format(value, spec)


WIDTH = 80
"""Every line fits a plain terminal."""
CELL = 21
"""Name and right-aligned value of one figure: three per row after the 13-column label."""


def row(label: str, *cells: tuple[str, str]) -> str:
    shown = (f"{k} {v:>{CELL - 1 - len(k)}}" for k, v in cells)
    return (f"  {label:<11}" + "  ".join(shown)).rstrip()


def wrap(text: str, indent: int) -> list[str]:
    """``text`` in lines of at most ``WIDTH``, continuations indented two more."""
    pad = " " * indent
    return textwrap.wrap(
        text, WIDTH, initial_indent=pad, subsequent_indent=pad + "  ", break_on_hyphens=False
    )


def counts(by_reason: dict[str, Any] | None) -> dict[str, Any]:
    """``{reason: n}`` of ``{reason: n}`` or of ``{reason: Lines}``."""
    items = (by_reason or {}).items()
    return {k: v.count if isinstance(v, ms.Lines) else v for k, v in items}


def reasons(by_reason: dict[str, Any] | None) -> str:
    """Nonzero counts by reason."""
    pairs = counts(by_reason).items()
    return ", ".join(f"{k} {n:,}" for k, n in pairs if isinstance(n, int) and n)


def total(by_reason: dict[str, Any] | None) -> int | None:
    if by_reason is None:
        return None
    return sum(v for v in counts(by_reason).values() if isinstance(v, int))


def mismatch_flag(ev: ms.EvalSet) -> str | None:
    """A loud line when speculative output ever differed from greedy: that is a bug, not noise."""
    bad = ev.lossless_mismatches
    if is_number(bad) and bad != 0:
        return (
            f"!!! LOSSLESS CHECK FAILED: {bad} of {num(ev.n_prompts)} prompts differ from "
            "the target's greedy output (must be 0) !!!"
        )
    return None


Cell = tuple[str, str, str]
"""(shown name, field of the file's model or a figure worked out here, format spec; "s" for
text) of one figure."""

INGEST: list[list[Cell]] = [
    [("read", "records_read", ","), ("train", "train", ","), ("heldout", "heldout", ",")],
    [("skipped", "skipped_n", ","), ("duplicates", "duplicates", ","),
     ("over max_conv", "left_out_by_max_conversations", ",")],
]  # fmt: skip
REGENERATE: list[list[Cell]] = [
    [("turns", "turns_regenerated", ","), ("tokens", "tokens_generated", ","),
     ("tokens/s", "rate", "s")],
    [("hit the cap", "cap_share", ".1%"), ("end in a loop", "loop_share", ".1%"),
     ("empty", "empty_responses", ",")],
]  # fmt: skip
TOKENIZE: list[list[Cell]] = [
    [("samples", "n_samples", ","), ("tokens", "n_tokens", ","),
     ("loss tokens", "n_loss_tokens", ",")],
    [("read", "conversations_read", ","), ("truncated", "truncated", ","),
     ("dropped", "dropped_n", ",")],
]  # fmt: skip
TARGET: list[list[Cell]] = [
    [("mode", "mode", "s"), ("held-out loss", "heldout_loss", ".3f"),
     ("perplexity", "heldout_perplexity", ".2f")],
]  # fmt: skip
BATCHING: list[list[Cell]] = [
    [("strategy", "strategy", "s"), ("steps", "n_steps", ","),
     ("micro-batches", "n_micro_batches", ",")],
    [("padding eff.", "padding_efficiency", ".3f"), ("rank imbalance", "rank_imbalance", ".3f"),
     ("frozen batches", "frozen_batch_fraction", ".3f")],
    [("pair overlap", "pair_overlap", ".3f"), ("window KS", "window_ks", ".3f")],
]  # fmt: skip
TRAINING: list[list[Cell]] = [
    [(m.label, m.name, m.spec) for m in shown(REPORT)[i : i + 3]]
    for i in range(0, len(shown(REPORT)), 3)
]
"""The training figures :data:`dflash.metrics.names.REPORT` names, in the table's order."""


def training(d: ms.Metrics) -> list[str]:
    """:data:`TRAINING`, less the figures only some runs have (a selector's) that this lacks."""
    held = d.present()
    cells = [cell for row in TRAINING for cell in row if BY_NAME[cell[1]].always or cell[1] in held]
    return grid(held, [cells[i : i + 3] for i in range(0, len(cells), 3)])


EVALUATION: list[list[Cell]] = [
    [("tau/response", "acceptance_length", ".2f"), ("tau 95% CI", "ci", "s"),
     ("tau pooled", "acceptance_length_pooled", ".2f")],
    [("tau z-lab", "acceptance_length_zlab", ".2f")],
    [("n-gram tau", "ngram_tau", ".2f"), ("untrained tau", "untrained_tau", ".2f"),
     ("x n-gram tau", "vs_ngram", ".2f")],
    [("speedup x", "speedup_shown", "s"), ("n-gram speedup", "ngram_speedup_shown", "s"),
     ("wall speedup x", "speedup_wall_shown", "s")],
    [("mismatches", "lossless_mismatches", ","), ("near-ties", "near_tie_divergences", ","),
     ("prompts", "n_prompts", ",")],
    [("loss short", "loss_short", ".3f"), ("loss medium", "loss_medium", ".3f"),
     ("loss long", "loss_long", ".3f")],
    [("answers capped", "answer_cap_fraction", ".1%"),
     ("answers loop", "answer_loop_fraction", ".1%"),
     ("dflash tok/s", "dflash_tokens_per_s", ",.0f")],
]  # fmt: skip


def grid(d: dict, rows: list[list[Cell]]) -> list[str]:
    def show(key: str, spec: str) -> str:
        value = d.get(key)
        return (value if isinstance(value, str) else "n/a") if spec == "s" else num(value, spec)

    return [row("", *((name, show(key, spec)) for name, key, spec in cells)) for cells in rows]


def because(what: str, by_reason: dict[str, Any] | None) -> list[str]:
    why = reasons(by_reason)
    return wrap(f"{what}: {why}", 13) if why else []


def figures(d: ms.Metrics | dict, rows: list[list[Cell]]) -> list[str]:
    """The grid of the keys a file had (a merged ``dict`` of them, for the token store)."""
    return grid(d if isinstance(d, dict) else d.present(), rows)


def ingest(d: ms.IngestReport) -> list[str]:
    given = "skipped_total" in d.model_fields_set
    skipped_n = d.skipped_total if given else total(d.skipped)
    kept = {"train": d.kept.train, "heldout": d.kept.heldout}
    flat = {**d.present(), **kept, "duplicates": d.duplicates_removed.count, "skipped_n": skipped_n}
    return grid(flat, INGEST) + because("skipped", d.skipped)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def share(part: Any, whole: Any) -> float | None:
    return part / whole if is_number(part) and is_number(whole) and whole else None


def looping_turns(root: Path) -> int | None:
    """Assistant turns of the regenerated data that end in a repeating tail.

    Turns beyond the window stay as people wrote them and rarely loop, so the count is set
    against the regenerated turns.
    """
    try:
        rows = read_conversations(root / RELATIVE.regenerated_conversations)
    except Exception:  # a report never raises: a missing or unreadable file shows n/a
        return None
    turns = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    return sum(text_ends_in_loop(text) for text in turns)


def regenerate(d: ms.RegenerateReport, root: Path) -> list[str]:
    if d.skipped:
        return [row("", ("skipped", "yes")) + "  (data.regenerate: false)"]
    rate = d.tokens_per_s
    rate = "cached" if rate is None and "tokens_per_s" in d.model_fields_set else num(rate, ",.0f")
    turns = d.turns_regenerated
    cap, loops = share(d.unterminated_responses, turns), share(looping_turns(root), turns)
    return grid({**d.present(), "rate": rate, "cap_share": cap, "loop_share": loops}, REGENERATE)


def tokenize(d: dict[str, Any]) -> list[str]:
    """The keys of the token store's manifest and of the tokenize report, merged."""
    flat = {**d, "dropped_n": total(d.get("dropped"))}
    return grid(flat, TOKENIZE) + because("dropped", d.get("dropped"))


def evaluation(d: ms.EvalDetails) -> list[str]:
    ngram, untrained = d.baselines.ngram, d.baselines.untrained
    ci = d.acceptance_length_ci95
    pair = isinstance(ci, list) and len(ci) == 2
    flat = {
        **d.present(),
        "ci": f"{num(ci[0], '.2f')}-{num(ci[1], '.2f')}" if pair else None,
        "ngram_tau": ngram.acceptance_length,
        "ngram_speedup": ngram.speedup,
        "untrained_tau": untrained.acceptance_length,
        "vs_ngram": share(d.acceptance_length, ngram.acceptance_length),
        **{f"loss_{k}": v for k, v in d.heldout_loss_by_length or ()},
    }
    noise = timing_noise(d)
    for key in ("speedup", "ngram_speedup", "speedup_wall"):
        shown = num(flat.get(key), ".2f")
        flat[f"{key}_shown"] = shown + ("?" if noise and shown != "n/a" else "")
    out = grid(flat, EVALUATION)
    if noise:
        out += wrap(f"? unreliable: {noise}", 13)
    per = d.per_position_acceptance or []
    out += by_position(per) if per else []
    flag = mismatch_flag(d)
    return out + (wrap(flag, 2) if flag else [])


POSITIONS = 15
"""Draft positions per pair of lines: 15 (block size 16) fit in 80 columns."""


def by_position(per: list[float]) -> list[str]:
    """Acceptance per draft position as aligned rows of position and percent."""
    out = [f"{'':13}accepted at draft position k, % of full-block steps:"]
    for start in range(0, len(per), POSITIONS):
        chunk = per[start : start + POSITIONS]
        ks = range(start + 1, start + len(chunk) + 1)
        out.append(f"{'':13}{'k':<4}" + "".join(f"{k:>4}" for k in ks))
        out.append(f"{'':13}{'%':<4}" + "".join(f"{100 * p:>4.0f}" for p in chunk))
    return out


def timing_noise(ev: ms.EvalSet) -> str | None:
    """Why the speedups are noise: an untrained drafter accepts almost nothing, so any speedup
    it shows above 1x comes from the timer, and the other speedups share that timer."""
    untrained = ev.baselines.untrained.speedup
    if not is_number(untrained) or untrained <= 1:
        return None
    return f"timing noise (the untrained drafter reads {untrained:.2f}x)"


MIN_PROMPTS = 20
"""Fewer scored prompts leave τ's interval too wide to tell two runs apart."""


def advice(regen: ms.RegenerateReport | str, ev: ms.EvalDetails | str) -> list[str]:
    """One sentence per figure that makes this run's result untrustworthy, with what to change."""
    out = []
    if isinstance(regen, str) or regen.skipped:
        regen = ms.partial(ms.RegenerateReport, {})
    capped = share(regen.unterminated_responses, regen.turns_regenerated)
    if capped is not None and capped > 0.5:
        out.append(
            f"{capped:.0%} of regenerated answers hit the length cap: the drafter learns cut-off "
            "answers. Raise regenerate.max_new_tokens and rerun from regenerate."
        )
    ev = ms.partial(ms.EvalDetails, {}) if isinstance(ev, str) else ev
    tau = ev.acceptance_length
    ngram = ev.baselines.ngram.acceptance_length
    ci = ev.acceptance_length_ci95
    low = ci[0] if isinstance(ci, list) and len(ci) == 2 and is_number(ci[0]) else tau
    if is_number(tau) and is_number(ngram) and min(tau, low) <= ngram:
        out.append(
            f"The drafter's tau {tau:.2f} (95% CI from {num(low, '.2f')}) is not above n-gram's "
            f"{ngram:.2f}: it has learned nothing copying the prompt would not give. Train on "
            "more conversations (data.max_conversations) or longer (train.epochs)"
            + (", after the cap above." if out else ".")
        )
    n = ev.n_prompts
    if is_number(n) and n < MIN_PROMPTS:
        out.append(
            f"Only {n} prompts were scored: tau and speedups are too noisy to compare runs. "
            f"Raise evaluate.num_prompts to {MIN_PROMPTS} or more, and data.eval_fraction "
            "if the held-out split is smaller."
        )
    noise = timing_noise(ev)
    if noise:
        out.append(
            f"Speedups are unreliable: {noise}. Compare tau instead, or time on an idle machine "
            "or a GPU."
        )
    return [line for text in out for line in wrap(f"! {text}", 2)]


CHECKED: list[tuple[Path, type[ms.Metrics], str]] = [
    (RELATIVE.ingest_report, ms.IngestReport, "ingest"),
    (RELATIVE.regenerate_report, ms.RegenerateReport, "regenerate"),
    (RELATIVE.regenerate_metrics, ms.RegenerateHeadline, "regenerate"),
    (RELATIVE.tokenize_report, ms.TokenizeReport, "tokenize"),
    (RELATIVE.tokenized / STORE_MANIFEST, ms.TokenManifest, "tokenize"),
    (RELATIVE.target_details, ms.TargetDetails, "target"),
    (RELATIVE.target_metrics, ms.TargetHeadline, "target"),
    (PLAN_SUMMARY, ms.PlanSummary, "plan"),
    (RELATIVE.plan_metrics, ms.PlanMetrics, "plan"),
    (RELATIVE.train_details, ms.TrainDetails, "train"),
    (RELATIVE.train_metrics, ms.TrainHeadline, "train"),
    (RELATIVE.eval_details, ms.EvalDetails, "evaluate"),
    (RELATIVE.eval_metrics, ms.EvalHeadline, "evaluate"),
]
"""Every file the report, ``dvc exp show`` and ``publish`` read, its model and its stage."""


def corrupt(root: Path) -> list[str]:
    """One warning per file cut short or holding a value of the wrong type. A section shows
    one file of a pair (details over headline), so a broken other one would pass unseen."""
    out = []
    for rel, model, stage in CHECKED:
        why = ms.flaw(model, root / rel, partial_ok=True) if (root / rel).exists() else None
        if why:
            out.append(
                f"{rel} is corrupt ({why}), so its figures are lost: rerun {stage} "
                f"(dvc repro {stage}) to write it again."
            )
    return [line for text in out for line in wrap(f"! {text}", 2)]


def unreadable_strata(d: ms.EvalDetails) -> bool:
    """Whether a set's ``strata`` (or ``sets`` itself) is there but of the wrong shape."""
    sets = {HELDOUT_SET: d, **(d.sets or {})}
    broken = [s for s in sets.values() if "strata" in s.model_fields_set and s.strata is None]
    return bool(broken) or ("sets" in d.model_fields_set and d.sets is None)


def scorecard(d: ms.EvalDetails) -> list[str]:
    """Set x stratum: τ per response, its 95% interval, the n-gram baseline's τ, prompts."""
    out = [f"{'':13}{'set':<12}{'stratum':<16}{'tau':>6}{'95% CI':>13}{'n-gram':>8}{'n':>6}"]
    if unreadable_strata(d):  # a hand-edited or partial file: no table
        return [f"{'':13}unreadable strata in {RELATIVE.eval_details}"]
    for r in scorecard_rows(d):
        ci = r.get("acceptance_length_ci95")
        pair = isinstance(ci, list) and len(ci) == 2
        shown = f"{num(ci[0], '.2f')}-{num(ci[1], '.2f')}" if pair else "n/a"
        out.append(
            f"{'':13}{r['set']:<12}{r['stratum']:<16}{num(r.get('acceptance_length'), '.2f'):>6}"
            f"{shown:>13}{num(r.get('ngram_acceptance_length'), '.2f'):>8}"
            f"{num(r.get('n_prompts')):>6}"
        )
    return out


def drafter_sources(d: ms.TrainDetails) -> list[str]:
    """Where the drafter's geometry came from: the params, or the checkpoint it started from."""
    sources = dict(d.drafter_sources or {})
    if not sources:
        return []
    start = sources.pop("init_from", "random weights")
    shown = ", ".join(f"{key} {value}" for key, value in sources.items())
    return wrap(f"drafter from {start}: {shown}", 13)


def section(label: str, stage: str, data: ms.Metrics | dict | str, lines: Any) -> list[str]:
    """``lines(data)`` under ``label``, or why there is nothing to show."""
    if isinstance(data, str):
        return [f"  {label:<11}" + (data or f"not run yet (dvc repro {stage})")]
    out = lines(data) if callable(lines) else figures(data, lines)
    return [f"  {label:<11}{out[0][13:]}", *out[1:]]


def batching(root: Path) -> dict[str, Any] | str:
    """The plan's figures, and its strategy from ``data/plans/summary.json``."""
    plan = read(root, ms.PlanMetrics, RELATIVE.plan_metrics, PLAN_SUMMARY)
    summary = read(root, ms.PlanSummary, PLAN_SUMMARY)
    if isinstance(plan, str):
        return plan
    has_meta = isinstance(summary, ms.PlanSummary) and "meta" in summary.model_fields_set
    return {"strategy": summary.meta.strategy, **plan.present()} if has_meta else plan.present()


def plan_lines(d: dict[str, Any]) -> list[str]:
    """The plan's figures, then what its strategy does, in the strategy module's own line."""
    name = d.get("strategy")
    if not isinstance(name, str):
        return grid(d, BATCHING)
    try:
        doc = strategy(name).doc
    except BatchingError:
        doc = "no module of dflash.batching.strategies nor plug-in defines it here"
    return grid(d, BATCHING) + wrap(f"{name}: {doc}", 13)


def token_store(root: Path) -> dict[str, Any] | str:
    """The keys of the tokenize report over those of the store's manifest, either alone."""
    report = read(root, ms.TokenizeReport, RELATIVE.tokenize_report)
    manifest = read(root, ms.TokenManifest, RELATIVE.tokenized / STORE_MANIFEST)
    tok = [d.present() for d in (report, manifest) if isinstance(d, ms.Metrics)]
    return {**tok[1], **tok[0]} if len(tok) == 2 else (tok[0] if tok else "")


def render_report(root: Path) -> str:
    """The report for the pipeline outputs under ``root`` (the directory ``dvc repro`` ran in)."""
    ev = read(root, ms.EvalDetails, RELATIVE.eval_details, RELATIVE.eval_metrics)
    flags = [None if isinstance(ev, str) else mismatch_flag(ev), stale_drafter(root)]
    flags = [flag if flag.startswith("!!!") else f"!!! {flag} !!!" for flag in flags if flag]
    lines = ["dflash report", *[line for flag in flags for line in wrap(flag, 0)], ""]
    lines += section(
        "ingest", "ingest", read(root, ms.IngestReport, RELATIVE.ingest_report), ingest
    )
    regen = read(root, ms.RegenerateReport, RELATIVE.regenerate_report)
    lines += section("regenerate", "regenerate", regen, lambda d: regenerate(d, root))
    lines += section("tokenize", "tokenize", token_store(root), tokenize)
    target = read(root, ms.TargetDetails, RELATIVE.target_details, RELATIVE.target_metrics)
    lines += ["", *section("target", "target", target, TARGET)]
    lines += ["", *section("batching", "plan", batching(root), plan_lines)]
    train = read(root, ms.TrainDetails, RELATIVE.train_details, RELATIVE.train_metrics)
    lines += ["", *section("training", "train", train, training)]
    lines += [] if isinstance(train, str) else drafter_sources(train)
    lines += ["", *section("evaluation", "evaluate", ev, evaluation)]
    if not isinstance(ev, str) and "strata" in ev.model_fields_set:
        lines += ["", *section("scorecard", "evaluate", ev, scorecard)]
    warnings = corrupt(root) + advice(regen, ev)
    lines += ["", "  warnings", *warnings] if warnings else []
    return "\n".join(lines) + "\n"


def run(config: Config, workspace: Workspace) -> int:
    """Print the report for the workspace; exit 1 when decoding was not lossless.

    The config is unused: every figure is read back from disk.
    """
    root = workspace.root.resolve()
    print(render_report(root), end="")
    evaluation = read(root, ms.EvalHeadline, RELATIVE.eval_metrics)
    mismatches = 0 if isinstance(evaluation, str) else evaluation.lossless_mismatches
    return 1 if mismatches else 0
