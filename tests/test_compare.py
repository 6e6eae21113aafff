"""``dflash compare`` on tiny experiments fabricated in a temporary git repository."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from dflash.cli import main
from dflash.commands.compare.paired import Row, train_rows
from dflash.commands.compare.screen import line
from dflash.eval.records import records_csv

PROMPTS = 40


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def write_run(
    repo: Path,
    strategy: str,
    seed: int,
    shift: float,
    tokens_per_s: float,
    prompts: list[int] | None = None,
) -> None:
    """A run's committed outputs: τ per prompt spread widely between prompts, plus ``shift``.
    ``prompts`` are the ids of the prompts scored, in their order in the set (all, in order,
    by default): prompt ``i`` has digest ``d{i}`` and its own τ in every run."""
    rng = np.random.default_rng(seed)
    spread = np.random.default_rng(99).uniform(1.5, 6.0, 1000)
    records = [
        {"set": "heldout", "prompt": row, "digest": f"d{i}",
         "strata": f"length:{'short' if i < PROMPTS // 2 else 'long'}",
         "tau": float(spread[i] + shift + rng.normal(0, 0.05)), "ngram_tau": 1.0, "tokens": 9}
        for row, i in enumerate(range(PROMPTS) if prompts is None else prompts)
    ]  # fmt: skip
    (repo / "metrics").mkdir(exist_ok=True)
    (repo / "metrics/eval_prompts.csv").write_text(records_csv(records))
    details = {"tokens_per_s": tokens_per_s, "padding_efficiency": 0.9,
               "final_loss": float("nan") if strategy == "nan-loss" else 2.0,
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


def strict(text: str) -> dict:
    """JSON as the standard has it: NaN and Infinity are no JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))


@pytest.mark.parametrize(
    ("name", "prompts", "n", "unpaired"),
    [
        ("reordered", list(range(PROMPTS))[::-1], PROMPTS, (0, 0)),
        ("fewer", list(range(0, PROMPTS, 2)), PROMPTS // 2, (PROMPTS // 2, 0)),
        ("others", [*range(7, 31), *range(500, 510)], 24, (16, 10)),
    ],
)
def test_prompts_pair_by_identity_not_by_row(repo, capsys, name, prompts, n, unpaired):
    """Runs whose sets hold the prompts in another order, fewer of them or other ones: each
    prompt meets its own partner, and those without one are counted and left out."""
    experiment(repo, f"exp-{name}", name, 0, 0.3, 1000.0, prompts)
    result = compared(capsys, "exp-sorted", f"exp-{name}")
    row = tau_all(result)
    assert row["n"] == n and row["delta"] == pytest.approx(0.3, abs=0.05)
    assert row["ci"][1] - row["ci"][0] < 0.1 and row["resolved"]
    assert result["comparisons"][0]["pairing"] == {
        "paired": n, "unpaired_first": unpaired[0], "unpaired_this": unpaired[1]
    }  # fmt: skip
    assert main(["compare", "exp-sorted", f"exp-{name}"]) == 0
    screen = capsys.readouterr().out
    note = f"τ: {n} prompts paired; left out, unpaired (another prompt or no τ): {unpaired[0]} of"
    assert (note in screen) == (unpaired != (0, 0))


@pytest.mark.parametrize(
    ("tau", "why"), [("nan", "a finite number"), ("inf", "a finite number"),
                     ("abc", "a finite number"), ("", None)],
)  # fmt: skip
def test_a_record_whose_tau_is_no_finite_number_exits_2_naming_file_and_line(
    repo, capsys, tau, why
):
    write_run(repo, "edited", 0, 0.2, 1000.0)  # the workspace, against HEAD
    path = repo / "metrics/eval_prompts.csv"
    lines = path.read_text().splitlines()
    cells = lines[5].split(",")
    cells[4] = tau  # the tau column of the fifth record (line 6)
    lines[5] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    code = main(["compare", "--json"])
    out, err = capsys.readouterr()
    if why is None:  # a prompt without a verification step: left unpaired, not refused
        assert code == 0 and strict(out)["comparisons"][0]["pairing"]["unpaired_first"] == 1
        return
    assert code == 2 and out == ""
    assert err == (f"dflash compare: the workspace's metrics/eval_prompts.csv, line 6: tau = "
                   f"{tau!r} is not {why}; evaluate the run again\n")  # fmt: skip


def test_a_nan_an_older_run_wrote_is_no_figure_and_the_json_stays_json(repo, capsys):
    experiment(repo, "exp-old", "nan-loss", 0, 0.3, 1000.0)
    assert main(["compare", "exp-sorted", "exp-old", "--json"]) == 0
    rows = strict(capsys.readouterr().out)["comparisons"][0]["rows"]
    loss = next(r for r in rows if r["figure"] == "final loss")
    assert loss["first"] == 2.0 and loss["this"] is None and loss["delta"] is None


def test_a_run_with_itself_or_with_its_own_params_is_nothing_to_compare(repo, capsys):
    head = git(repo, "rev-parse", "HEAD")[:7]
    exp = git(repo, "for-each-ref", "--format=%(objectname)", "refs/exps/**/exp-sorted")[:7]
    cases = [
        (
            ["exp-sorted", "exp-sorted"],
            f"exp-sorted and exp-sorted are the same run (commit {exp})",
        ),
        (["HEAD", head], f"HEAD and {head} are the same run (commit {head})"),
        (["exp-packed", "exp-packed-1"], "the runs differ only in their seeds"),
        ([], "the runs have the same params, seeds included"),  # the workspace is HEAD's
    ]
    for names, said in cases:
        assert main(["compare", *names]) == 2
        assert capsys.readouterr().err == f"dflash compare: {said}: nothing to compare\n"


def test_a_selectors_figures_are_compared_only_where_a_run_has_them():
    def run(**train):
        return SimpleNamespace(train={"tokens_per_s": 1000.0} | train)

    plain, walked = [run()], [run(final_path_accuracy=0.5, final_top_k_oracle_tau=4.0)]
    figures = [r.figure for r in train_rows(plain, plain)]
    assert "tokens/s" in figures and "projected h" in figures and "path acc." not in figures
    rows = {r.figure: r for r in train_rows(walked, walked)}
    assert rows["path acc."].first == 0.5 and rows["oracle τ"].this == 4.0
    assert rows["path acc."].delta == 0.0 and "selector acc." not in rows
    one_side = {r.figure: r for r in train_rows(plain, walked)}
    assert one_side["path acc."].first is None and one_side["path acc."].this == 0.5
