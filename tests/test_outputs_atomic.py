"""Stage outputs appear complete or not at all: each writer is killed between two writes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_stages

from dflash.batching import length_stats as stats
from dflash.batching.params import PlanParams
from dflash.model import hf_files
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""


class Killed(BaseException):
    """Stands for SIGKILL: nothing may catch it and carry on."""


def snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def kill_on_call(monkeypatch, target: str):
    def die(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(target, die)


def test_stats_are_replaced_whole(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 200, 300)
    params = PlanParams("bucketed", token_budget=1024, max_seq_len=256, max_batch_size=16)
    out = tmp_path / "stats"
    stats.write_stats(lengths, 3, params, out)
    before = snapshot(out)
    kill_on_call(monkeypatch, "dflash.batching.length_stats.plot_lengths")  # after three files
    with pytest.raises(Killed):
        stats.write_stats(lengths[:100], 3, params, out)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]


def test_target_is_replaced_whole(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    before = snapshot(WS.target)
    # The tokenizer is saved after the model's weights: die in between.
    kill_on_call(monkeypatch, "transformers.PreTrainedTokenizerBase.save_pretrained")
    with pytest.raises(Killed):
        run_stages(tiny_workspace, ["target"], ["target.seed=5"])
    assert snapshot(WS.target) == before
    assert not WS.target_metrics.exists(), "metrics of the old target must not stay beside"
    assert sorted(p.name for p in WS.target.parent.iterdir()) == ["target", "tokenizer"]


def test_evaluate_leaves_no_old_metrics_beside_new_rows(tiny_workspace, monkeypatch):
    """Killed after its rows and before its metrics, evaluate leaves its new rows whole and no
    metrics of an older run beside them: neither the headline nor the details."""
    monkeypatch.chdir(tiny_workspace)
    old = {
        WS.eval_metrics: '{"acceptance_length": 9.9}\n',
        WS.eval_details: '{"acceptance_length": 9.9}\n',
        WS.eval_acceptance: "position,acceptance\n1,0.999\n",
        WS.eval_prompts: "old\n",
    }
    for path, text in old.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    one = ["train.world_size=1", "train.epochs=1"]
    run_stages(tiny_workspace, ["plan", "train"], one)
    kill_on_call(monkeypatch, "dflash.stages.evaluate.write_json_atomic")  # metrics come last
    with pytest.raises(Killed):
        run_stages(tiny_workspace, ["evaluate"], one)
    assert not WS.eval_metrics.exists() and not WS.eval_details.exists()
    header, *rows = WS.eval_acceptance.read_text().splitlines()
    assert header == "position,acceptance" and rows != ["1,0.999"]  # this run's rows
    positions = [int(row.split(",")[0]) for row in rows]
    assert positions == list(range(1, len(rows) + 1))
    assert all(0 <= float(row.split(",")[1]) <= 1 for row in rows)
    assert WS.eval_prompts.read_text() != old[WS.eval_prompts] and WS.eval_strata.exists()


def lengths_file(tmp_path):
    path = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"length": np.arange(10, 60, dtype=np.int32)}), path)
    return path


@pytest.mark.parametrize(
    "module, args, words",
    [
        ("dflash.batching.planner", ["--epochs", "0"], ["--epochs", "0", ">= 1"]),
        (
            "dflash.batching.planner",
            ["--num-buckets", "0", "--strategy", "bucketed"],
            ["--num-buckets", "0"],
        ),
        ("dflash.batching.planner", ["--world-size", "-2"], ["--world-size", "-2", ">= 1"]),
        ("dflash.batching.length_stats", ["--num-buckets", "0"], ["--num-buckets", "0", ">= 1"]),
        (
            "dflash.batching.length_stats",
            ["--num-buckets", "2", "--token-budget", "x"],
            ["--token-budget", "'x'"],
        ),
    ],
)
def test_plan_and_stats_clis_reject_out_of_domain_values(tmp_path, module, args, words):
    base = ["--lengths", str(lengths_file(tmp_path)), "--out", str(tmp_path / "out")]
    if module == "dflash.batching.planner":
        base += ["--max-seq-len", "64", "--max-batch-size", "4", "--token-budget", "256"]
        base += [] if "--strategy" in args else ["--strategy", "shuffle"]
    else:
        base += [] if "--token-budget" in args else ["--token-budget", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", module, *base, *args], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_gitignore_dvc_keeps_in_an_output_directory_survives(tmp_path):
    from dflash.fileio import atomic_dir, require_only

    out = tmp_path / "stats"
    out.mkdir()
    (out / ".gitignore").write_text("/buckets.json\n")
    (out / "buckets.json").write_text("old")
    require_only(out, ["buckets.json"])
    with atomic_dir(out) as tmp:
        (tmp / "buckets.json").write_text("new")
    assert snapshot(out) == {
        out.joinpath(".gitignore").relative_to(out): b"/buckets.json\n",
        out.joinpath("buckets.json").relative_to(out): b"new",
    }


def test_train_leaves_no_old_metrics_beside_a_new_drafter(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    WS.train_metrics.parent.mkdir(parents=True, exist_ok=True)
    WS.train_metrics.write_text('{"final_loss": 0.001}\n')
    kill_on_call(monkeypatch, "dflash.train.loop.write_metrics")  # metrics come last
    with pytest.raises(Killed):
        run_stages(tiny_workspace, ["plan", "train"], ["train.world_size=1", "train.epochs=1"])
    assert not WS.train_metrics.exists()
    assert sorted(p.name for p in WS.drafter.iterdir()) == sorted(
        [hf_files.MODEL_CARD, hf_files.CONFIG, hf_files.WEIGHTS, hf_files.REMOTE_CODE]
    )
