"""bench/sweep_table.py turns `dvc exp show --json` into mean ± std per strategy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sweep_table.py"
spec = importlib.util.spec_from_file_location("sweep_table", SCRIPT)
sweep_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep_table)


def entry(rev: str, strategy: str, seed: int, tau: float, spikes: int, experiments=None) -> dict:
    params = {"batching": {"strategy": strategy, "seed": seed}, "train": {"seed": seed}}
    train = {"padding_efficiency": 0.9, "tokens_per_s": 1000.0 + seed, "loss_spikes": spikes,
             "grad_norm_cv": 0.5}  # fmt: skip
    evaluation = {
        "acceptance_length": tau,
        "baselines": {"ngram": {"acceptance_length": 1.5}},
        "heldout_loss_by_length": {"short": 1.0, "medium": 2.0, "long": 3.0},
    }
    data = {
        "params": {"params.yaml": {"data": params}},
        "metrics": {
            "metrics/train.json": {"data": train},
            "metrics/eval.json": {"data": evaluation},
        },
    }
    return {"rev": rev, "name": None, "data": data, "experiments": experiments}


def exp(rev: str, *args) -> dict:
    return {"revs": [entry(rev, *args)], "executor": None, "name": rev}


@pytest.fixture
def shown() -> list[dict]:
    experiments = [
        exp("e1", "sorted", 0, 4.0, 6),
        exp("e2", "sorted", 1, 5.0, 2),
        exp("e3", "sorted", 2, 6.0, 4),
        exp("e4", "packed", 0, 5.5, 0),
    ]
    # The workspace and the baseline commit repeat sorted/seed 0 with stale figures.
    return [
        entry("workspace", "sorted", 0, 9.9, 99),
        entry("abc123", "sorted", 0, 9.9, 99, experiments=experiments),
    ]


def test_one_run_per_params_with_experiments_first(shown):
    found = sweep_table.runs(shown)
    assert len(found) == 4
    taus = sorted(r["metrics"]["metrics/eval.json"]["acceptance_length"] for r in found)
    assert taus == [4.0, 5.0, 5.5, 6.0]


def test_table_shows_mean_and_std_per_strategy(shown, tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(shown))
    assert sweep_table.main(["--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| strategy | runs | padding eff. | tokens/s | spikes")
    sorted_row = next(line for line in lines if line.startswith("| sorted"))
    assert "| 3 |" in sorted_row
    assert "5.00 ± 1.00" in sorted_row  # τ over seeds 0, 1, 2
    assert "4.0 ± 2.0" in sorted_row  # spikes
    assert "1,001 ± 1" in sorted_row and "1.50 ± 0.00" in sorted_row
    packed_row = next(line for line in lines if line.startswith("| packed"))
    assert "| 1 |" in packed_row and "5.50" in packed_row
    assert not any(line.startswith("| shuffle") for line in lines)


def test_queued_and_running_experiments_are_left_out(shown):
    pending = [
        {**exp("q1", "shuffle", 0, 9.0, 0), "executor": {"state": state}}
        for state in ("queued", "running", "failed")
    ]
    shown[1]["experiments"] += pending
    strategies = {r["params"]["batching"]["strategy"] for r in sweep_table.runs(shown)}
    assert "shuffle" not in strategies
