"""The library runs from any directory, installed: no ``dvc.yaml``, no working directory.

A fresh process in an empty directory outside the checkout plans the tiny workspace's token
store, trains on the plan and exports the drafter, every path passed in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import dflash

SCRIPT = """
import sys
from pathlib import Path

from dflash.batching.lengths import read_lengths
from dflash.batching.planner import params_from_config, write_plans
from dflash.data.store import STORE_INDEX
from dflash.config.params import load_config
from dflash.train.run_files import Declared, TrainFiles
from dflash.train.loop import train

inputs, out = Path(sys.argv[1]), Path(sys.argv[2])
sets = ["train.world_size=1", "train.epochs=1", "batching.token_budget=4096",
        "batching.max_batch_size=64"]
config = load_config(inputs / "params.yaml", sets)
lengths = read_lengths(inputs / "tokenized" / STORE_INDEX)
params = params_from_config(config, lengths, inputs / "no_stats")
summary = write_plans(lengths, params, 1, out / "plans")
print("steps", summary["n_steps"])
files = TrainFiles(
    tokenized=inputs / "tokenized", plans=out / "plans", target=inputs / "target",
    tokenizer=inputs / "tokenizer", heldout=inputs / "heldout.parquet",
    checkpoints=out / "checkpoints", drafter=out / "drafter", metrics=out / "train.json",
    details=out / "train_details.json", log=out / "log.csv", live=out / "live",
)
train(config, files, Declared(config.model_dump(mode="json"), {"code": "outside"}))
"""


def python_env(cwd: Path) -> dict[str, str]:
    """The environment without the checkout on the path: the installed package is imported.

    Only when the installed ``dflash`` is another copy than the one under test (a second
    worktree beside an editable install) does the path name this one's root, and never the
    working directory.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run(
        [sys.executable, "-c", "import dflash; print(dflash.__file__)"],
        cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip
    tested = Path(dflash.__file__).resolve()
    if found.returncode != 0 or Path(found.stdout.strip()).resolve() != tested:
        env["PYTHONPATH"] = str(tested.parents[1])
    return env


def test_plan_train_and_export_outside_the_checkout(tiny_workspace_template, tmp_path):
    inputs, out, cwd = tmp_path / "inputs", tmp_path / "out", tmp_path / "elsewhere"
    for made in (inputs, out, cwd):
        made.mkdir()
    template = tiny_workspace_template
    shutil.copy(template / "params.yaml", inputs / "params.yaml")
    shutil.copy(template / "data/ingested/heldout.parquet", inputs / "heldout.parquet")
    for name, source in [("tokenized", "data/tokenized"), ("tokenizer", "models/tokenizer"),
                         ("target", "models/target")]:  # fmt: skip
        shutil.copytree(template / source, inputs / name)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(inputs), str(out)],
        cwd=cwd, env=python_env(cwd), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "steps" in proc.stdout
    for made in ("plans/summary.json", "drafter/config.json", "drafter/model.safetensors",
                 "drafter/README.md", "train.json", "log.csv"):  # fmt: skip
        assert (out / made).is_file(), made
    assert not any(cwd.iterdir()), "nothing is written to the working directory"
