"""``dflash report`` reads whatever the stages left and never raises on missing or partial files."""

import json
import subprocess
import sys
from pathlib import Path

from dflash.batching.registry import strategy
from dflash.commands.report import render_report
from dflash.data.conversations import write_conversations

FILES = {
    "data/ingested/ingest_report.json": {
        "records_read": 2000,
        "kept": {"train": 1890, "heldout": 98},
        "skipped": {
            "invalid_json": {"count": 3, "first_lines": [4]},
            "empty_content": {"count": 0},
        },
        "skipped_total": 3,
        "duplicates_removed": {"count": 9, "first_lines": []},
        "left_out_by_max_conversations": 0,
    },
    "data/regenerated/report.json": {
        "skipped": False,
        "turns_regenerated": 4321,
        "tokens_generated": 98765,
        "tokens_per_s": 1234.5,
        "unterminated_responses": 1296,
        "empty_responses": 2,
    },
    "data/tokenized/manifest.json": {
        "n_samples": 1870,
        "n_tokens": 456789,
        "n_loss_tokens": 200000,
        "conversations_read": 1890,
        "truncated": 17,
        "dropped": {"overlength": 0, "too_few_loss_tokens": 20},
    },
    "data/tokenized/tokenize_report.json": {"n_samples": 1870, "length": {"p50": 200}},
    "metrics/target_details.json": {
        "mode": "pretrained",
        "heldout_loss": 3.2101,
        "heldout_perplexity": 24.78,
    },
    "data/plans/summary.json": {"meta": {"strategy": "bucketed"}, "n_steps": 1},
    "metrics/plan.json": {
        "n_steps": 120,
        "n_micro_batches": 240,
        "padding_efficiency": 0.9123,
        "rank_imbalance": 0.031,
        "frozen_batch_fraction": 0.0,
        "pair_overlap": 0.012,
        "window_ks": 0.05,
        "epochs": [{"epoch": 0}],
    },
    "metrics/train_details.json": {
        "final_loss": 2.345,
        "final_accuracy": 0.4567,
        "tokens_per_s": 54321.0,
        "padded_tokens_per_s": 60000.0,
        "data_wait_fraction": 0.021,
        "steps": 720,
        "skipped_steps": 0,
        "world_size": 2,
        "train_seconds": 300.0,
        "loss_spikes": 4,
        "grad_norm_cv": 0.4321,
        "loss_length_corr": 0.12,
        "planned_steps": 720,
        "projected_hours": 0.083,
    },
    "metrics/eval_details.json": {
        "acceptance_length": 3.456,
        "acceptance_length_zlab": 3.812,
        "acceptance_length_pooled": 3.012,
        "acceptance_length_ci95": [3.1, 3.8],
        "per_position_acceptance": [0.9, 0.75, 0.5],
        "lossless_mismatches": 0,
        "near_tie_divergences": 1,
        "n_prompts": 20,
        "greedy_tokens_per_s": 100.0,
        "dflash_tokens_per_s": 250.0,
        "speedup": 2.5,
        "speedup_wall": 2.25,
        "baselines": {
            "ngram": {"acceptance_length": 1.382, "speedup": 1.2},
            "untrained": {"acceptance_length": 1.004, "speedup": 0.5},
        },
        "heldout_loss_by_length": {"short": 1.111, "medium": 2.222, "long": 3.333},
        "answer_cap_fraction": 0.25,
        "answer_loop_fraction": 0.125,
    },
}


def write(root: Path, files: dict) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_empty_directory_says_what_to_run(tmp_path):
    text = render_report(tmp_path)
    for stage in ("ingest", "regenerate", "tokenize", "target", "plan", "train", "evaluate"):
        assert f"not run yet (dvc repro {stage})" in text
    assert "LOSSLESS" not in text


REGENERATED = [
    {"conversation_id": "a", "messages": [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "i am fine i am fine i am fine i am fine"},
        {"role": "user", "content": "and you"},
        {"role": "assistant", "content": "good to hear from you today"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "\n" * 48},
    ]},
]  # fmt: skip


def test_batching_says_what_its_strategy_does(tmp_path):
    write(tmp_path, {"data/plans/summary.json": {"meta": {"strategy": "bucketed"}, "n_steps": 1}})
    assert f"bucketed: {strategy('bucketed').doc[:40]}" in render_report(tmp_path)
    write(tmp_path, {"data/plans/summary.json": {"meta": {"strategy": "gone"}, "n_steps": 1}})
    assert "gone: no module of dflash.batching.strategies" in render_report(tmp_path)


def test_full_run_shows_key_figures(tmp_path):
    write(tmp_path, FILES)
    write_conversations(REGENERATED, tmp_path / "data/regenerated/conversations.parquet")
    text = render_report(tmp_path)
    assert "not run yet" not in text and "n/a" not in text
    for figure in ("2,000", "1,890", "invalid_json 3", "4,321", "1,234", "456,789"):
        assert figure in text
    for figure in ("too_few_loss_tokens 20", "3.210", "24.78", "bucketed", "0.912", "120"):
        assert figure in text
    for figure in ("2.345", "54,321", "2.1%", "720", "3.46", "2.50"):
        assert figure in text
    for figure in ("30.0%", "0.43", "3.10-3.80", "3.01", "1.38", "1.00", "2.50", "2.25"):
        assert figure in text  # cap and loop shares, stability, τ and both baselines
    for figure in ("1.111", "3.333", "25.0%", "12.5%"):
        assert figure in text
    assert "empty_content" not in text  # zero counts stay off the screen
    assert "LOSSLESS" not in text and "warnings" not in text and "?" not in text
    assert len(text.splitlines()) <= 42
    assert max(map(len, text.splitlines())) <= 80
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "accepted at draft position" in line)
    assert lines[at + 1].split() == ["k", "1", "2", "3"]
    assert lines[at + 2].split() == ["%", "90", "75", "50"]


def test_scorecard_lists_every_set_and_stratum(tmp_path):
    stratum = {"n_prompts": 7, "acceptance_length": 2.5, "acceptance_length_ci95": [2.0, 3.0],
               "ngram_acceptance_length": 1.25}  # fmt: skip
    empty = {"n_prompts": 0, "acceptance_length": None, "acceptance_length_ci95": None}
    heldout = {**FILES["metrics/eval_details.json"], "strata": {"tools": {"with": empty}}}
    gsm = {**heldout, "n_prompts": 9, "strata": {"length": {"short": stratum}}}
    write(tmp_path, {"metrics/eval_details.json": {**heldout, "sets": {"gsm8k": gsm}}})
    lines = render_report(tmp_path).splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("  scorecard")) :]
    assert table[0].split() == ["scorecard", "set", "stratum", "tau", "95%", "CI", "n-gram", "n"]
    assert table[1].split() == ["heldout", "all", "3.46", "3.10-3.80", "1.38", "20"]
    assert table[2].split() == ["heldout", "tools:with", "n/a", "n/a", "n/a", "0"]
    assert table[3].split() == ["gsm8k", "all", "3.46", "3.10-3.80", "1.38", "9"]
    assert table[4].split() == ["gsm8k", "length:short", "2.50", "2.00-3.00", "1.25", "7"]
    broken = {**heldout, "strata": {"tools": ["not", "a", "mapping"]}}
    write(tmp_path, {"metrics/eval_details.json": broken})
    assert "unreadable strata in metrics/eval_details.json" in render_report(tmp_path)


def test_nonzero_mismatches_are_flagged(tmp_path):
    write(
        tmp_path,
        {
            "metrics/eval_details.json": {
                **FILES["metrics/eval_details.json"],
                "lossless_mismatches": 3,
            }
        },
    )
    text = render_report(tmp_path)
    assert text.count("LOSSLESS CHECK FAILED: 3 of 20") == 2  # top of the screen and its section


def test_partial_and_broken_files_do_not_raise(tmp_path):
    write(
        tmp_path,
        {
            "metrics/train_details.json": {"final_loss": None, "steps": "many"},
            "metrics/eval_details.json": "{not json",
            "data/ingested/ingest_report.json": {"kept": [], "skipped": 5},
            "data/regenerated/report.json": {"skipped": True, "conversations": 10},
            "data/plans/summary.json": {"meta": {"strategy": "packed"}, "padding_efficiency": 0.99},
            "metrics/target_details.json": [1, 2],
        },
    )
    text = render_report(tmp_path)
    assert "unreadable metrics/eval_details.json" in text
    assert "unreadable metrics/target_details.json" in text
    assert "packed" in text and "0.990" in text  # plan falls back to data/plans/summary.json
    assert "skipped" in text and "n/a" in text


def test_loop_share_counts_word_and_character_loops_of_regenerated_turns(tmp_path):
    report = {**FILES["data/regenerated/report.json"], "turns_regenerated": 4}
    write(tmp_path, {"data/regenerated/report.json": report})
    write_conversations(REGENERATED, tmp_path / "data/regenerated/conversations.parquet")
    assert "end in a loop   50.0%" in render_report(tmp_path)


def test_every_line_fits_80_columns_with_long_counts_and_flags(tmp_path):
    ingest = {**FILES["data/ingested/ingest_report.json"], "records_read": 123_456_789_012}
    ingest["skipped"] = {f"reason_number_{i}": {"count": 1000 + i} for i in range(9)}
    ev = {**FILES["metrics/eval_details.json"], "lossless_mismatches": 3}
    ev["per_position_acceptance"] = [1.0] * 31
    write(tmp_path, {**FILES, "data/ingested/ingest_report.json": ingest,
                     "metrics/eval_details.json": ev})  # fmt: skip
    (tmp_path / "models/drafter").mkdir(parents=True)  # no train.json: a stale-drafter flag
    lines = render_report(tmp_path).splitlines()
    assert max(map(len, lines)) <= 80
    assert "reason_number_8 1,008" in " ".join(lines)
    assert sum(line.split()[:1] == ["k"] for line in lines) == 3  # 31 positions, 15 a row


BAD_RUN = {
    "data/regenerated/report.json": {**FILES["data/regenerated/report.json"],
                                     "turns_regenerated": 1000, "unterminated_responses": 686},
    "metrics/eval_details.json": {**FILES["metrics/eval_details.json"], "n_prompts": 12,
                                  "acceptance_length": 1.15, "speedup": 3.11,
                                  "acceptance_length_ci95": [1.1, 1.21],
                                  "baselines": {"ngram": {"acceptance_length": 1.14},
                                                "untrained": {"speedup": 1.45}}},
}  # fmt: skip


def warnings_of(text: str) -> str:
    lines = text.splitlines()
    return " ".join(lines[lines.index("  warnings") + 1 :]) if "  warnings" in lines else ""


def test_each_untrustworthy_figure_warns_with_what_to_change(tmp_path):
    write(tmp_path, BAD_RUN)
    text = render_report(tmp_path)
    assert max(map(len, text.splitlines())) <= 80
    said = " ".join(warnings_of(text).split())
    assert "69% of regenerated answers hit the length cap" in said
    assert "regenerate.max_new_tokens" in said
    assert "tau 1.15 (95% CI from 1.10) is not above n-gram's 1.14" in said
    assert "train.epochs" in said
    assert "Only 12 prompts were scored" in said and "evaluate.num_prompts" in said
    assert "Speedups are unreliable" in said and "1.45x" in said
    assert "3.11?" in text  # the speedups themselves are marked


def test_each_warning_has_its_own_trigger(tmp_path):
    ev = FILES["metrics/eval_details.json"]
    cases = {
        "length cap": {"data/regenerated/report.json": BAD_RUN["data/regenerated/report.json"]},
        "n-gram's": {"metrics/eval_details.json": {**ev, "acceptance_length": 1.382}},
        "not above": {"metrics/eval_details.json": {**ev, "acceptance_length_ci95": [1.3, 3.8]}},
        "prompts were scored": {"metrics/eval_details.json": {**ev, "n_prompts": 19}},
        "unreliable": {"metrics/eval_details.json": {
            **ev, "baselines": {**ev["baselines"], "untrained": {"speedup": 1.01}}}},
    }  # fmt: skip
    for phrase, files in cases.items():
        write(tmp_path, {**FILES, **files})
        said = " ".join(warnings_of(render_report(tmp_path)).split())
        assert phrase in said, phrase
        assert ("n-gram's" in said) == (phrase in ("n-gram's", "not above")), said
        assert len([p for p in cases if p in said and p != "not above"]) == 1, said


def test_report_starts_without_torch():
    code = "import sys, dflash.commands.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_figure_is_a_field_of_its_files_model_or_worked_out_by_the_report():
    from dflash.commands import report
    from dflash.metrics import schema as ms

    worked_out = {"train", "heldout", "duplicates", "skipped_n", "rate", "cap_share",
                  "loop_share", "dropped_n", "strategy", "ci", "ngram_tau", "untrained_tau",
                  "vs_ngram", "speedup_shown", "ngram_speedup_shown", "speedup_wall_shown",
                  "loss_short", "loss_medium", "loss_long"}  # fmt: skip
    tables = {
        "INGEST": ms.IngestReport,
        "REGENERATE": ms.RegenerateReport,
        "TOKENIZE": ms.TokenizeReport,
        "TARGET": ms.TargetDetails,
        "BATCHING": ms.PlanMetrics,
        "TRAINING": ms.TrainDetails,
        "EVALUATION": ms.EvalDetails,
    }
    for name, model in tables.items():
        keys = {key for cells in getattr(report, name) for _, key, _ in cells}
        assert keys <= set(model.model_fields) | worked_out, (name, keys - set(model.model_fields))


HEADLINES = {
    "metrics/train.json": {"tokens_per_s": 54321.0, "steps": 720, "final_loss": 2.345},
    "metrics/eval.json": {"acceptance_length": 3.456, "n_prompts": 20},
    "metrics/target.json": {"heldout_perplexity": 24.78},
    "metrics/regenerate.json": {"conversations": 10},
}
"""The headline files ``dvc exp show`` reads, beside the details the report shows."""


def test_a_corrupt_or_wrong_typed_metrics_file_is_a_warning(tmp_path):
    healthy = {**FILES, **HEADLINES}
    write(tmp_path, healthy)
    assert warnings_of(render_report(tmp_path)) == ""  # a partial file is no warning
    for rel, text in healthy.items():
        whole = json.dumps(text)
        for bad in (whole[: min(50, len(whole) - 1)], "[1, 2, 3]"):  # cut short, wrong type
            write(tmp_path, {rel: bad})
            said = " ".join(warnings_of(render_report(tmp_path)).split())
            assert f"{rel} is corrupt" in said, (rel, bad)
        write(tmp_path, {rel: text})
    write(tmp_path, {"metrics/train.json": {**HEADLINES["metrics/train.json"], "steps": "720"}})
    said = " ".join(warnings_of(render_report(tmp_path)).split())
    assert "metrics/train.json is corrupt (steps:" in said and "dvc repro train" in said


def test_a_selectors_figures_show_only_for_a_run_that_has_them(tmp_path):
    write(tmp_path, FILES)
    assert "path acc." not in render_report(tmp_path)
    selector = {"final_top_k_recall": 0.875, "final_selector_accuracy": 0.625,
                "final_path_accuracy": 0.5, "final_top_k_oracle_tau": 4.25}  # fmt: skip
    write(tmp_path, {"metrics/train_details.json": FILES["metrics/train_details.json"] | selector})
    text = render_report(tmp_path)
    for figure in ("top-K recall 0.875", "selector acc. 0.625", "path acc. 0.500", "oracle τ 4.25"):
        assert figure in " ".join(text.split()), figure
