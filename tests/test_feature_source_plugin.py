"""A feature source added as one module of ``dflash.features.sources`` (in a copy of the
package): the params accept it, the params page lists it and a run trains on its features."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.config.params import load_config
from dflash.features.choices import feature_choices, topologies
from dflash.features.registry import kind_of

ROOT = Path(__file__).resolve().parents[1]

TOY = '''"""``toy``: seeded noise as wide as the target's features, and no target at all."""

import torch

from dflash.features.source import Inputs, Kind
from dflash.model.layer_ids import feature_width

PARAM = "train.features"


class Noise:
    def __init__(self, width, device):
        self.width, self.device = width, device
        self.generator = torch.Generator().manual_seed(0)

    def heldout(self):
        return None

    def start(self, epoch, step):
        pass

    def epoch(self, steps, first_step):
        pass

    def __call__(self, mb):
        noise = torch.randn((*mb.input_ids.shape, self.width), generator=self.generator)
        return (noise * (mb.document_ids >= 0)[..., None]).to(self.device)

    def finish(self):
        return {"target_idle_fraction": 0.0, "drafter_wait_fraction": 0.0, "target_forwards": 0}


def build(run: Inputs) -> Noise:
    width = feature_width(run.layer_ids, run.target.config.hidden_size, run.last)
    return Noise(width, run.placement.ctx.device)


SOURCE = Kind(name="toy", build=build)
'''


def test_the_built_in_sources_are_found_by_their_modules():
    assert topologies() == ("colocated", "decoupled", "engine")
    assert feature_choices() == ("target", "files")
    names = {
        (): "colocated",
        ("train.topology=decoupled",): "decoupled",
        ("train.topology=engine", "engine.endpoints=[http://h:1/v1]"): "engine",
        ("train.features=files",): "files",
        ("train.topology=engine", "engine.endpoints=[http://h:1/v1]", "train.features=files"): (
            "files"
        ),
    }
    for sets, name in names.items():
        assert kind_of(load_config(None, list(sets)).train).name == name


def run(args: list[str], cwd: Path, repo: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_a_toy_feature_source_added_as_one_module_trains(tiny_workspace, tmp_path):
    repo = tmp_path / "repo"
    for name in ("dflash", "stages"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo)
    (repo / "dflash/features/sources/toy.py").write_text(TOY)

    page = tmp_path / "params_page.txt"
    run(["-m", "dflash.config.doc", str(page)], tmp_path, repo)
    assert "`target` \\| `files` \\| `toy`" in page.read_text()
    assert "- ``toy``: seeded noise as wide as the target's features" in page.read_text()

    sets = ["train.features=toy", "train.world_size=1", "train.epochs=1", "train.max_steps=2"]
    sets += ["train.checkpoint_every=1000", "logging.every=1000"]
    for stage in ("plan", "train"):
        run(["-m", "dflash.cli", stage, *(f"--set={s}" for s in sets)], tiny_workspace, repo)
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert details["steps"] == 2 and math.isfinite(details["final_loss"])
    assert details["target_forwards"] == 0  # the toy's own count: no target ran
    assert details["null_reasons"]["final_simulated_tau"].startswith("no held-out batch")
