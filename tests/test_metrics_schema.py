"""The metrics models describe the files exactly: each file of a tiny run validates and its
model writes it back byte for byte; the committed JSON Schemas are the models' own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from declaration import ROOT
from test_headline import TRAIN_DETAILS

from dflash.batching.io import PLAN_SUMMARY
from dflash.data.store import STORE_MANIFEST
from dflash.fileio import write_json_atomic
from dflash.metrics import schema as ms
from dflash.metrics.headline import write_metrics
from dflash.pipeline.workspace import Workspace
from dflash.train.checkpointing.state import TrainState
from dflash.train.observe.summary import NO_HELDOUT, NO_STEP, NOT_FINITE, final_figures

WS = Workspace(Path())
SCHEMAS = Path("docs/schemas")

DATA_FILES = {
    WS.ingest_report: (ms.IngestReport, False),
    WS.tokenized / STORE_MANIFEST: (ms.TokenManifest, False),
    WS.tokenize_report: (ms.TokenizeReport, False),
    WS.regenerate_report: (ms.RegenerateReport, True),
    WS.regenerate_metrics: (ms.RegenerateHeadline, True),
    WS.target_details: (ms.TargetDetails, True),
    WS.target_metrics: (ms.TargetHeadline, True),
    WS.plans / PLAN_SUMMARY: (ms.PlanSummary, False),
    WS.plan_metrics: (ms.PlanMetrics, False),
}
"""Every file the data stages write, its model and whether its writer sorts its keys."""
RUN_FILES = {
    WS.train_details: (ms.TrainDetails, True),
    WS.train_metrics: (ms.TrainHeadline, True),
    WS.eval_details: (ms.EvalDetails, True),
    WS.eval_metrics: (ms.EvalHeadline, True),
}
"""The files of ``train`` and ``evaluate``."""


def assert_files_round_trip(root: Path, files: dict = DATA_FILES) -> None:
    """Each file under ``root`` validates as its model, and the model dumps it byte for byte
    both read from JSON and built from a dict, as the writers build it."""
    for rel, (model, sort_keys) in files.items():
        text = (root / rel).read_text()
        for read in (model.model_validate_json(text), model.model_validate(json.loads(text))):
            assert json.dumps(read.dump(), indent=2, sort_keys=sort_keys) + "\n" == text, rel


def test_every_file_of_the_data_stages_round_trips(tiny_workspace_template):
    assert_files_round_trip(tiny_workspace_template)


def test_every_file_has_a_schema_and_the_committed_schemas_are_current():
    directory = ROOT / SCHEMAS
    expected = {ms.SCHEMA_FILE.format(name=name): m for name, m in ms.FILES.items()}
    assert sorted(p.name for p in directory.iterdir()) == sorted(expected)
    stale = [n for n, m in expected.items() if (directory / n).read_text() != ms.schema_text(m)]
    assert not stale, f"{stale} are stale: python -m dflash.metrics.schema {SCHEMAS}"
    models = {m for m, _ in [*DATA_FILES.values(), *RUN_FILES.values()]}
    assert models == set(ms.FILES.values())


def test_a_partial_file_keeps_what_fits_and_reads_none_elsewhere():
    data = {"acceptance_length": 2.5, "n_prompts": "many", "baselines": {"ngram": 3}, "x": 1}
    ev = ms.partial(ms.EvalDetails, data)
    assert ev.acceptance_length == 2.5 and ev.n_prompts is None and ev.speedup is None
    assert ev.baselines.ngram.acceptance_length is None  # a chain of attributes never fails
    assert ev.model_fields_set == {"acceptance_length", "n_prompts", "baselines"}
    stratum = {"n_prompts": 2}
    ev = ms.partial(ms.EvalDetails, {"strata": {"tools": {"with": stratum}}})
    assert ev.strata["tools"]["with"].n_prompts == 2
    assert ms.partial(ms.EvalDetails, {"strata": {"tools": [1]}}).strata is None


def test_read_says_why_a_file_is_no_json_object(tmp_path):
    (tmp_path / "a.json").write_text("[1, 2]")
    (tmp_path / "b.json").write_text("{not json")
    assert ms.read(ms.TrainDetails, tmp_path / "a.json") == "not a JSON object"
    assert ms.read(ms.TrainDetails, tmp_path / "b.json") == "JSONDecodeError"


def test_the_schema_module_starts_without_torch():
    code = "import sys, dflash.metrics.schema; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_null_where_a_nested_object_goes_still_reads_as_one():
    report = ms.partial(ms.IngestReport, {"kept": None, "skipped": {"a": None}})
    assert report.kept.train is None and report.skipped["a"].count is None
    assert ms.partial(ms.RegenerateReport, {"engine": {"x": None}}).engine == {"x": None}


def test_a_file_holds_the_keys_its_writer_gave_in_the_models_order():
    """Hand-written expectations, independent of ``dump``: an optional key left out stays out,
    one given as None is written as null, and the keys come in the file's (the model's) order."""
    given = {"skipped": False, "seconds": None, "conversations": 3}
    report = ms.RegenerateReport.model_validate(given)
    assert json.dumps(report.dump()) == '{"conversations": 3, "seconds": null, "skipped": false}'
    read = ms.RegenerateReport.model_validate_json('{"conversations": 1, "skipped": true}')
    assert read.dump() == {"conversations": 1, "skipped": True}
    kept = ms.IngestReport.model_validate_json(
        '{"source": "s", "records_read": 2, "kept": {"train": 1, "heldout": 1}, "skipped": {},'
        ' "skipped_total": 0, "duplicates_removed": {"count": 0, "first_lines": []},'
        ' "duplicate_ids_renamed": {"count": 0, "first_lines": []}, "eval_fraction": 0.5,'
        ' "max_conversations": null, "left_out_by_max_conversations": 0}'
    ).dump()
    assert list(kept) == ["source", "records_read", "kept", "skipped", "skipped_total",
                          "duplicates_removed", "duplicate_ids_renamed", "eval_fraction",
                          "max_conversations", "left_out_by_max_conversations"]  # fmt: skip
    assert kept["kept"] == {"train": 1, "heldout": 1} and kept["max_conversations"] is None


def strict_json(text: str) -> dict:
    """``text`` as JSON as the standard has it: a NaN or Infinity is refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is no JSON")

    return json.loads(text, parse_constant=refuse)


def details_of(**figures) -> ms.TrainDetails:
    return ms.TrainDetails.model_validate(TRAIN_DETAILS | figures)


def test_a_run_without_steps_writes_null_figures_with_their_reasons(tmp_path):

    figures, reasons = final_figures(TrainState(), measured_tau=True)
    assert figures == {"final_loss": None, "final_accuracy": None, "final_simulated_tau": None}
    assert reasons == dict.fromkeys(figures, NO_STEP)
    assert "train.max_steps: 0" in NO_STEP
    write_metrics(tmp_path / "train.json", tmp_path / "details.json",
                  details_of(**figures, null_reasons=reasons), ms.TrainHeadline)  # fmt: skip
    details = strict_json((tmp_path / "details.json").read_text())
    assert details["final_loss"] is None and details["null_reasons"] == reasons
    headline = strict_json((tmp_path / "train.json").read_text())
    assert headline["final_loss"] is None
    assert headline["null_reasons"] == {"final_loss": NO_STEP}  # only the headline's figures

    engine = TrainState(global_step=2, epoch_loss=[(0, 2.5, 1.0), (0, 1.5, 3.0)],
                        rows=[{"step": 2, "loss": 1.7, "accuracy": 0.25}])  # fmt: skip
    figures, reasons = final_figures(engine, measured_tau=False)
    assert figures == {"final_loss": 1.75, "final_accuracy": 0.25, "final_simulated_tau": None}
    assert reasons == {"final_simulated_tau": NO_HELDOUT}


def test_a_non_finite_figure_is_null_and_no_json_writer_writes_nan(tmp_path):

    state = TrainState(
        global_step=1,
        epoch_loss=[(0, 1.0, 1.0)],
        rows=[{"loss": 1.0, "accuracy": 0.5, "simulated_tau": float("nan")}],
    )
    figures, reasons = final_figures(state, measured_tau=True)
    assert figures["final_simulated_tau"] is None and reasons == {"final_simulated_tau": NOT_FINITE}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not JSON compliant"):
            write_json_atomic(tmp_path / "m.json", {"final_loss": bad})
        assert not list(tmp_path.iterdir())  # nothing written, no temporary file left
