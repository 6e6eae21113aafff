"""The metrics models describe the files exactly: each file of a tiny run validates and its
model writes it back byte for byte; the committed JSON Schemas are the models' own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from declaration import ROOT

from dflash import metrics_schema as ms
from dflash.batching.io import PLAN_SUMMARY
from dflash.data.store import STORE_MANIFEST
from dflash.workspace import Workspace

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
    assert not stale, f"{stale} are stale: python -m dflash.metrics_schema {SCHEMAS}"
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
    code = "import sys, dflash.metrics_schema; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_null_where_a_nested_object_goes_still_reads_as_one():
    report = ms.partial(ms.IngestReport, {"kept": None, "skipped": {"a": None}})
    assert report.kept.train is None and report.skipped["a"].count is None
    assert ms.partial(ms.RegenerateReport, {"engine": {"x": None}}).engine == {"x": None}
