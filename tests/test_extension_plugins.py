"""Objectives, position weights and drafter families are extension points like batching
strategies: one module each, found by file. A toy of each, added as one module to a copy of the
package, is listed by the params and trains; a bad choice is an exit-2 error naming the key and
what is allowed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_drafter

from dflash import cli
from dflash.config import plugins
from dflash.config.schema import Config
from dflash.model import families, losses, position_weights
from dflash.model.drafter import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]
PARAMS = str(ROOT / "params.yaml")

REGISTRIES = {
    ("objective", "loss"): losses,
    ("objective", "position_weight"): position_weights,
    ("drafter", "family"): families,
}
"""Each param that picks an extension and the module that loads its choices."""

TOY_LOSS = '''"""``toy``: half the cross-entropy."""

import os
from pathlib import Path

from dflash.objectives import Loss, ce


def terms(log_q, q, target, log_p):
    Path(os.environ["TOY_MARKS"], "objective").touch()
    loss, grad = ce.terms(log_q, q, target, log_p)
    return 0.5 * loss, 0.5 * grad


OBJECTIVE = Loss(name="toy", terms=terms)
'''

TOY_WEIGHT = '''"""``flat``: every drafted slot weighs 1."""

import os
from pathlib import Path

import torch

from dflash.objectives.weights import PositionWeight


def slots(block_size, gamma):
    Path(os.environ["TOY_MARKS"], "position_weight").touch()
    weights = torch.ones(block_size)
    weights[0] = 0.0
    return weights


POSITION_WEIGHT = PositionWeight(name="flat", slots=slots)
'''

TOY_FAMILY = '''"""``toy``: the DFlash drafter, exported under its own architecture name."""

import os
from pathlib import Path

from dflash.drafters import Family
from dflash.model.drafter import DFlashDrafter
from dflash.model.imported import checkpoint_weights


class ToyDrafter(DFlashDrafter):
    def config_json(self, target_config=None, dtype=None):
        return super().config_json(target_config, dtype) | {"architectures": ["ToyDraftModel"]}


def build(d, target, tokenizer, seed):
    Path(os.environ["TOY_MARKS"], "family").touch()
    return ToyDrafter.from_target(
        target, block_size=d.block_size, num_hidden_layers=d.num_hidden_layers,
        num_target_features=d.num_target_features, mask_token_id=tokenizer.mask_token_id,
        mask_token=tokenizer.mask_token, seed=seed,
    )


def start_from(d, checkpoint, depth, mask_token, target):
    config = checkpoint.drafter_config(depth, mask_token)
    return ToyDrafter.from_weights(config, checkpoint_weights(checkpoint), target)


DRAFTER = Family(
    name="toy", architecture="ToyDraftModel", build=build, start_from=start_from,
    load=ToyDrafter.from_pretrained,
)
'''

TOYS = {
    "dflash/objectives/toy.py": TOY_LOSS,
    "dflash/objectives/weights/flat.py": TOY_WEIGHT,
    "dflash/drafters/toy.py": TOY_FAMILY,
}
"""The one module each toy is, by where it goes in the package."""


def test_the_params_list_the_built_in_modules():
    assert plugins.names("dflash.objectives", "OBJECTIVE") == ("ce", "ce+kl", "kl")
    assert plugins.names("dflash.objectives.weights", "POSITION_WEIGHT") == ("decay", "dpace")
    assert plugins.names("dflash.drafters", "DRAFTER") == ("dflash", "dflash2")


@pytest.mark.parametrize(("section", "key"), sorted(REGISTRIES))
def test_each_param_lists_what_its_registry_loads(section, key):
    """The schema lists the names without importing the modules (every stage loads the params);
    the registry that imports them declares the same package for the stages' closures."""
    registry = REGISTRIES[(section, key)]
    listed = plugins.names(registry.PLUGIN_PACKAGE, registry.ATTRIBUTE)
    field = type(getattr(Config(), section)).model_fields[key]
    assert field.metadata[-1].names() == listed
    for name in listed:
        loaded = plugins.load(registry.PLUGIN_PACKAGE, registry.ATTRIBUTE, name, object, "k")
        assert loaded.name == name


def test_an_export_is_read_back_by_the_family_it_names(tmp_path, target):
    tiny_drafter(target).save_pretrained(tmp_path)
    assert families.family_of(tmp_path).name == "dflash"
    assert type(families.load_drafter(tmp_path, target)) is DFlashDrafter


@pytest.mark.parametrize(
    ("setting", "allowed"),
    [
        ("objective.loss=jsd", "'ce', 'ce+kl', 'kl'"),
        ("objective.position_weight=flat", "'decay', 'dpace'"),
        ("drafter.family=eagle", "'dflash'"),
    ],
)
def test_a_bad_choice_exits_2_naming_the_key_and_the_allowed_values(
    tmp_path, monkeypatch, capsys, setting, allowed
):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["ingest", "--params", PARAMS, "--set", setting]) == 2
    err = capsys.readouterr().err
    key, value = setting.split("=")
    assert f"{key} = {value!r}" in err and allowed in err and "Traceback" not in err


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """A copy of the package (and the ``dvc.yaml`` it reads) with one module added per toy."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "dflash", copy / "dflash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", copy / "dvc.yaml")
    for path, text in TOYS.items():
        (copy / path).write_text(text)
    return copy


def in_copy(copy: Path, marks: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python args`` in ``cwd`` with the copy first on the path."""
    path = os.pathsep.join(p for p in (str(copy), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TOY_MARKS": str(marks), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_toy_objective_weight_and_family_each_one_module_train(package_copy, tiny_workspace):
    marks = tiny_workspace / "marks"
    marks.mkdir()
    listed = in_copy(package_copy, marks, tiny_workspace, "-c", (
        "from dflash.config.doc import render; from dflash.config.params import load_config\n"
        "c = load_config(None, ['objective.loss=toy', 'objective.position_weight=flat',"
        " 'drafter.family=toy'])\n"
        "print(c.objective.loss, c.objective.position_weight, c.drafter.family)\n"
        "print(render())"
    ))  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-4000:]
    assert listed.stdout.startswith("toy flat toy\n")
    for doc in ("``toy``: half the cross-entropy.", "``flat``: every drafted slot weighs 1."):
        assert f"- {doc}" in listed.stdout
    sets = ["objective.loss=toy", "objective.position_weight=flat", "drafter.family=toy"]
    sets += ["train.max_steps=2", "train.checkpoint_every=1000"]
    run = in_copy(package_copy, marks, tiny_workspace, "-m", "dflash.cli", "train",
                  *(f"--set={s}" for s in sets))  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert sorted(p.name for p in marks.iterdir()) == ["family", "objective", "position_weight"]
    metrics = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert metrics["steps"] == 2
    config = json.loads((tiny_workspace / "models/drafter/config.json").read_text())
    assert config["architectures"] == ["ToyDraftModel"]
