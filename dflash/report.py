"""``dflash report``: one screen of what the pipeline did, read back from the stages' JSON files.

Every stage already writes its figures; this gathers the ones a user checks first (what was
dropped, padding, loss, acceptance, losslessness) so ``make repro`` ends with a summary. It reads
whatever exists and never raises: a stage without output says how to run it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from dflash.batching.io import PLAN_SUMMARY as PLAN_SUMMARY_FILE
from dflash.config import Config
from dflash.data.conversations import read_conversations
from dflash.data.store import STORE_MANIFEST
from dflash.eval.loops import text_ends_in_loop
from dflash.eval.strata import scorecard_rows
from dflash.freshness import stale_drafter
from dflash.workspace import Workspace

NAMES = Workspace()
"""The workspace's paths relative to its root."""

TOKENIZE_FILES = (NAMES.tokenize_report, NAMES.tokenized / STORE_MANIFEST)
PLAN_SUMMARY = NAMES.plans / PLAN_SUMMARY_FILE


def read(root: Path, *rels: Path) -> dict | str:
    """The JSON object at the first existing path, else why not ("" when none exists)."""
    for rel in rels:
        path = root / rel
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            return f"unreadable {rel}: {type(err).__name__}"
        return data if isinstance(data, dict) else f"unreadable {rel}: not a JSON object"
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


def reasons(counts: Any) -> str:
    """Nonzero counts by reason, ``{reason: n}`` or ``{reason: {"count": n}}``."""
    if not isinstance(counts, dict):
        return ""
    pairs = [(k, v.get("count") if isinstance(v, dict) else v) for k, v in counts.items()]
    return ", ".join(f"{k} {n:,}" for k, n in pairs if isinstance(n, int) and n)


def total(counts: Any) -> int | None:
    if not isinstance(counts, dict):
        return None
    values = [v.get("count") if isinstance(v, dict) else v for v in counts.values()]
    return sum(v for v in values if isinstance(v, int))


def mismatch_flag(ev: dict) -> str | None:
    """A loud line when speculative output ever differed from greedy: that is a bug, not noise."""
    bad = ev.get("lossless_mismatches")
    if isinstance(bad, int | float) and not isinstance(bad, bool) and bad != 0:
        return (
            f"!!! LOSSLESS CHECK FAILED: {bad} of {num(ev.get('n_prompts'))} prompts differ from "
            "the target's greedy output (must be 0) !!!"
        )
    return None


Cell = tuple[str, str, str]
"""(shown name, JSON key, format spec; "s" for text) of one figure."""

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
    [("final loss", "final_loss", ".3f"), ("accuracy", "final_accuracy", ".3f"),
     ("steps", "steps", ",")],
    [("tokens/s", "tokens_per_s", ",.0f"), ("padded tok/s", "padded_tokens_per_s", ",.0f"),
     ("skipped steps", "skipped_steps", ",")],
    [("data wait", "data_wait_fraction", ".1%"), ("world size", "world_size", ","),
     ("seconds", "train_seconds", ",.0f")],
    [("loss spikes", "loss_spikes", ","), ("grad-norm CV", "grad_norm_cv", ".2f")],
]  # fmt: skip
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


def because(what: str, counts: Any) -> list[str]:
    why = reasons(counts)
    return wrap(f"{what}: {why}", 13) if why else []


def as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def ingest(d: dict) -> list[str]:
    kept, dup = as_dict(d.get("kept")), as_dict(d.get("duplicates_removed"))
    skipped_n = d.get("skipped_total", total(d.get("skipped")))
    flat = {**d, **kept, "duplicates": dup.get("count"), "skipped_n": skipped_n}
    return grid(flat, INGEST) + because("skipped", d.get("skipped"))


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
        rows = read_conversations(root / NAMES.regenerated_conversations)
    except Exception:  # a report never raises: a missing or unreadable file shows n/a
        return None
    turns = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    return sum(text_ends_in_loop(text) for text in turns)


def regenerate(d: dict, root: Path) -> list[str]:
    if d.get("skipped"):
        return [row("", ("skipped", "yes")) + "  (data.regenerate: false)"]
    rate = d.get("tokens_per_s")
    rate = "cached" if rate is None and "tokens_per_s" in d else num(rate, ",.0f")
    turns = d.get("turns_regenerated")
    cap, loops = share(d.get("unterminated_responses"), turns), share(looping_turns(root), turns)
    return grid({**d, "rate": rate, "cap_share": cap, "loop_share": loops}, REGENERATE)


def tokenize(d: dict) -> list[str]:
    flat = {**d, "dropped_n": total(d.get("dropped"))}
    return grid(flat, TOKENIZE) + because("dropped", d.get("dropped"))


def evaluation(d: dict) -> list[str]:
    base = as_dict(d.get("baselines"))
    ngram, untrained = as_dict(base.get("ngram")), as_dict(base.get("untrained"))
    ci = d.get("acceptance_length_ci95")
    by_length = as_dict(d.get("heldout_loss_by_length"))
    flat = {
        **d,
        "ci": f"{num(ci[0], '.2f')}-{num(ci[1], '.2f')}" if isinstance(ci, list) else None,
        "ngram_tau": ngram.get("acceptance_length"),
        "ngram_speedup": ngram.get("speedup"),
        "untrained_tau": untrained.get("acceptance_length"),
        "vs_ngram": share(d.get("acceptance_length"), ngram.get("acceptance_length")),
        **{f"loss_{k}": v for k, v in by_length.items()},
    }
    noise = timing_noise(d)
    for key in ("speedup", "ngram_speedup", "speedup_wall"):
        shown = num(flat.get(key), ".2f")
        flat[f"{key}_shown"] = shown + ("?" if noise and shown != "n/a" else "")
    out = grid(flat, EVALUATION)
    if noise:
        out += wrap(f"? unreliable: {noise}", 13)
    per = d.get("per_position_acceptance")
    per = [p for p in per if isinstance(p, int | float)] if isinstance(per, list) else []
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


def timing_noise(ev: dict) -> str | None:
    """Why the speedups are noise: an untrained drafter accepts almost nothing, so any speedup
    it shows above 1x comes from the timer, and the other speedups share that timer."""
    untrained = as_dict(as_dict(ev.get("baselines")).get("untrained")).get("speedup")
    if not is_number(untrained) or untrained <= 1:
        return None
    return f"timing noise (the untrained drafter reads {untrained:.2f}x)"


MIN_PROMPTS = 20
"""Fewer scored prompts leave τ's interval too wide to tell two runs apart."""


def advice(regen: dict | str, ev: dict | str) -> list[str]:
    """One sentence per figure that makes this run's result untrustworthy, with what to change."""
    out = []
    regen = regen if isinstance(regen, dict) and not regen.get("skipped") else {}
    capped = share(regen.get("unterminated_responses"), regen.get("turns_regenerated"))
    if capped is not None and capped > 0.5:
        out.append(
            f"{capped:.0%} of regenerated answers hit the length cap: the drafter learns cut-off "
            "answers. Raise regenerate.max_new_tokens and rerun from regenerate."
        )
    ev = ev if isinstance(ev, dict) else {}
    tau = ev.get("acceptance_length")
    ngram = as_dict(as_dict(ev.get("baselines")).get("ngram")).get("acceptance_length")
    ci = ev.get("acceptance_length_ci95")
    low = ci[0] if isinstance(ci, list) and len(ci) == 2 and is_number(ci[0]) else tau
    if is_number(tau) and is_number(ngram) and min(tau, low) <= ngram:
        out.append(
            f"The drafter's tau {tau:.2f} (95% CI from {num(low, '.2f')}) is not above n-gram's "
            f"{ngram:.2f}: it has learned nothing copying the prompt would not give. Train on "
            "more conversations (data.max_conversations) or longer (train.epochs)"
            + (", after the cap above." if out else ".")
        )
    n = ev.get("n_prompts")
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


def scorecard(d: dict) -> list[str]:
    """Set x stratum: τ per response, its 95% interval, the n-gram baseline's τ, prompts."""
    out = [f"{'':13}{'set':<12}{'stratum':<16}{'tau':>6}{'95% CI':>13}{'n-gram':>8}{'n':>6}"]
    try:
        flat = scorecard_rows(d)
    except (AttributeError, TypeError, KeyError):  # a hand-edited or partial file: no table
        return [f"{'':13}unreadable strata in {NAMES.eval_details}"]
    for r in flat:
        ci = r.get("acceptance_length_ci95")
        pair = isinstance(ci, list) and len(ci) == 2
        shown = f"{num(ci[0], '.2f')}-{num(ci[1], '.2f')}" if pair else "n/a"
        out.append(
            f"{'':13}{r['set']:<12}{r['stratum']:<16}{num(r.get('acceptance_length'), '.2f'):>6}"
            f"{shown:>13}{num(r.get('ngram_acceptance_length'), '.2f'):>8}"
            f"{num(r.get('n_prompts')):>6}"
        )
    return out


def section(label: str, stage: str, data: dict | str, lines: Any) -> list[str]:
    """``lines(data)`` under ``label``, or why there is nothing to show."""
    if isinstance(data, str):
        return [f"  {label:<11}" + (data or f"not run yet (dvc repro {stage})")]
    out = lines(data) if callable(lines) else grid(data, lines)
    return [f"  {label:<11}{out[0][13:]}", *out[1:]]


def render_report(root: Path) -> str:
    """The report for the pipeline outputs under ``root`` (the directory ``dvc repro`` ran in)."""
    plan = read(root, NAMES.plan_metrics, PLAN_SUMMARY)
    summary = read(root, PLAN_SUMMARY)
    meta = summary.get("meta") if isinstance(summary, dict) else None
    if isinstance(plan, dict) and isinstance(meta, dict):
        plan = {"strategy": meta.get("strategy"), **plan}
    tok = [d for d in (read(root, rel) for rel in TOKENIZE_FILES) if isinstance(d, dict)]
    ev = read(root, NAMES.eval_details, NAMES.eval_metrics)
    flags = [mismatch_flag(ev) if isinstance(ev, dict) else None, stale_drafter(root)]
    flags = [flag if flag.startswith("!!!") else f"!!! {flag} !!!" for flag in flags if flag]
    lines = ["dflash report", *[line for flag in flags for line in wrap(flag, 0)], ""]
    lines += section("ingest", "ingest", read(root, NAMES.ingest_report), ingest)
    regen = read(root, NAMES.regenerate_report)
    lines += section("regenerate", "regenerate", regen, lambda d: regenerate(d, root))
    tok_data = {**tok[1], **tok[0]} if len(tok) == 2 else (tok[0] if tok else "")
    lines += section("tokenize", "tokenize", tok_data, tokenize)
    lines += [
        "",
        *section(
            "target", "target", read(root, NAMES.target_details, NAMES.target_metrics), TARGET
        ),
    ]
    lines += ["", *section("batching", "plan", plan, BATCHING)]
    lines += [
        "",
        *section(
            "training", "train", read(root, NAMES.train_details, NAMES.train_metrics), TRAINING
        ),
    ]
    lines += ["", *section("evaluation", "evaluate", ev, evaluation)]
    if isinstance(ev, dict) and "strata" in ev:
        lines += ["", *section("scorecard", "evaluate", ev, scorecard)]
    warnings = advice(regen, ev)
    lines += ["", "  warnings", *warnings] if warnings else []
    return "\n".join(lines) + "\n"


def run(config: Config, workspace: Workspace) -> int:
    """Print the report for the workspace; exit 1 when decoding was not lossless.

    The config is unused: every figure is read back from disk.
    """
    root = workspace.root.resolve()
    print(render_report(root), end="")
    evaluation = read(root, NAMES.eval_metrics)
    mismatches = evaluation.get("lossless_mismatches", 0) if isinstance(evaluation, dict) else 0
    return 1 if mismatches else 0
