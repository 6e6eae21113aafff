"""``dflash compare`` on tiny experiments fabricated in a temporary git repository."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from dflash.cli import main
from dflash.compare.paired import Row
from dflash.compare.screen import line
from dflash.eval.records import records_csv

PROMPTS = 40


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def write_run(repo: Path, strategy: str, seed: int, shift: float, tokens_per_s: float) -> None:
    """A run's committed outputs: τ per prompt spread widely between prompts, plus ``shift``."""
    rng = np.random.default_rng(seed)
    spread = np.random.default_rng(99).uniform(1.5, 6.0, PROMPTS)
    records = [
        {"set": "heldout", "prompt": i, "digest": f"d{i}",
         "strata": f"length:{'short' if i < PROMPTS // 2 else 'long'}",
         "tau": float(spread[i] + shift + rng.normal(0, 0.05)), "ngram_tau": 1.0, "tokens": 9}
        for i in range(PROMPTS)
    ]  # fmt: skip
    (repo / "metrics").mkdir(exist_ok=True)
    (repo / "metrics/eval_prompts.csv").write_text(records_csv(records))
    details = {"tokens_per_s": tokens_per_s, "padding_efficiency": 0.9, "final_loss": 2.0,
               "projected_hours": 1000 / tokens_per_s}  # fmt: skip
    (repo / "metrics/train_details.json").write_text(json.dumps(details))
    params = {"batching": {"strategy": strategy, "seed": seed}, "train": {"seed": seed}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))


def experiment(repo: Path, name: str, *run: object) -> None:
    """Commit a run as DVC does, on a ref under the baseline, leaving HEAD where it was."""
    head = git(repo, "rev-parse", "HEAD")
    write_run(repo, *run)
    git(repo, "add", "-A")
    tree = git(repo, "write-tree")
    commit = git(repo, "commit-tree", tree, "-p", head, "-m", name)
    git(repo, "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/{name}", commit)
    git(repo, "reset", "-q", "--hard")


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    write_run(tmp_path, "bucketed", 0, 0.0, 1000.0)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "baseline")
    experiment(tmp_path, "exp-packed", "packed", 0, 0.3, 1250.0)
    experiment(tmp_path, "exp-packed-1", "packed", 1, 0.3, 1200.0)
    experiment(tmp_path, "exp-sorted", "sorted", 0, 0.0, 1000.0)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def compared(capsys, *args: str) -> dict:
    assert main(["compare", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def tau_all(result: dict, index: int = 0) -> dict:
    rows = result["comparisons"][index]["rows"]
    return next(r for r in rows if r["figure"] == "tau" and r["stratum"] == "all")


def test_two_experiments_are_paired_prompt_by_prompt(repo, capsys):
    assert main(["compare", "exp-sorted", "exp-packed"]) == 0
    screen = capsys.readouterr().out
    assert all(len(line) <= 100 for line in screen.splitlines())
    line = next(x for x in screen.splitlines() if "τ heldout all" in x)
    assert "+0.30*" in line
    result = compared(capsys, "exp-sorted", "exp-packed")
    row = tau_all(result)
    assert row["resolved"] and row["n"] == PROMPTS and row["delta"] == pytest.approx(0.3, abs=0.05)
    # The prompts' spread cancels in the pairs: each run's own interval is far wider than 0.3
    # and the two overlap, while the paired one is tight around the shift.
    assert row["first_ci"][1] > row["this_ci"][0]
    assert row["ci"][1] - row["ci"][0] < 0.1
    strata = {r["stratum"] for r in result["comparisons"][0]["rows"] if r["figure"] == "tau"}
    assert strata == {"all", "length:short", "length:long"}
    speed = next(r for r in result["comparisons"][0]["rows"] if r["figure"] == "tokens/s")
    assert speed["delta"] == 250.0 and speed["ci"] is None


def test_runs_differing_only_in_seeds_are_pooled(repo, capsys):
    result = compared(capsys, "exp-sorted", "exp-packed", "exp-packed-1")
    assert len(result["comparisons"]) == 1
    assert [r["name"] for r in result["comparisons"][0]["this"]] == ["exp-packed", "exp-packed-1"]
    assert tau_all(result)["resolved"]


def test_no_name_compares_the_workspace_with_head_and_one_name_its_baseline(repo, capsys):
    write_run(repo, "shuffle", 0, -0.5, 900.0)
    result = compared(capsys)
    assert (
        result["first"][0]["name"] == "HEAD" and result["comparisons"][0]["this"][0]["rev"] is None
    )
    assert tau_all(result)["delta"] == pytest.approx(-0.5, abs=0.05)
    result = compared(capsys, "exp-packed")
    assert result["first"][0]["rev"] == git(repo, "rev-parse", "HEAD")
    assert tau_all(result)["delta"] == pytest.approx(0.3, abs=0.05)


def test_an_unknown_run_or_one_without_records_exits_2_naming_it(repo, capsys):
    assert main(["compare", "exp-sorted", "nope"]) == 2
    assert "no experiment or git revision named nope" in capsys.readouterr().err
    (repo / "metrics/eval_prompts.csv").unlink()
    assert main(["compare"]) == 2
    assert "the workspace has no metrics/eval_prompts.csv" in capsys.readouterr().err


def test_a_pilots_projection_is_shown_in_minutes_with_its_whole_interval():
    hours = Row("projected h", None, None, 2, 0.0013, None, 0.00139, None, 9.21e-05,
                [-0.000315, 0.000499])  # fmt: skip
    shown = line(hours)
    assert shown.split() == ["projected", "s", "2", "4.68", "5.00", "+0.33", "(+7%)",
                             "[-1.13,", "+1.80]"]  # fmt: skip
    minutes = line(Row("projected h", None, None, 1, 0.05, None, 0.04, None, -0.01, None))
    assert minutes.split()[:5] == ["projected", "min", "1", "3.00", "2.40"]
