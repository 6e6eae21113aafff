"""Training from a checkpoint through the stage: it starts where the checkpoint's run ended, and
a checkpoint made for another target or other params stops the run before any training."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import run_stages, tiny_qwen3
from run_outputs import losses

from dflash import cli
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import export_drafter

SHORT = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1000",
         "batching.token_budget=1536", "batching.max_batch_size=32"]  # fmt: skip
"""One rank, one epoch of a few large steps: seconds on two CPU cores."""


@pytest.mark.slow
def test_fine_tuning_an_export_starts_where_its_run_ended(tiny_workspace):
    run_stages(tiny_workspace, ["stats", "plan", "train"], SHORT)
    scratch = losses(tiny_workspace)
    shutil.copytree(tiny_workspace / "models/drafter", tiny_workspace / "models/init/first")
    run_stages(tiny_workspace, ["train"], [*SHORT, "drafter.init_from=models/init/first"])
    tuned = losses(tiny_workspace)
    learned = scratch[0] - scratch[-1]
    assert learned > 0.5
    assert abs(tuned[0] - scratch[-1]) < 0.2 * learned  # where the first run ended
    assert tuned[-1] < tuned[0]
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert details["drafter_sources"]["init_from"] == "models/init/first (z-lab)"
    assert details["drafter_sources"]["num_hidden_layers"] == "1 (params = checkpoint)"


def test_a_checkpoint_for_another_target_exits_2_before_training(
    tiny_workspace, monkeypatch, capsys
):
    other = tiny_qwen3(vocab_size=300)
    drafter = DFlashDrafter.from_target(
        other, block_size=4, num_hidden_layers=1, num_target_features=2, mask_token_id=3
    )
    export_drafter(drafter, tiny_workspace / "models/init/other", other.config, torch.float32)
    monkeypatch.chdir(tiny_workspace)
    init = "drafter.init_from=models/init/other"
    for sets, named in (
        ([init], "vocabulary 300, the target's is"),
        ([init, "drafter.num_hidden_layers=2"], "drafter.num_hidden_layers = 2 but the"),
    ):
        assert cli.main(["train", *(a for s in sets for a in ("--set", s))]) == 2
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err
    assert not list((tiny_workspace / "checkpoints").glob("**/step_*"))


def test_a_checkpoint_with_a_nan_weight_exits_2_naming_it(tiny_workspace, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    from dflash.model.load import load_target

    target = load_target(tiny_workspace / "models/target")
    drafter = DFlashDrafter.from_target(
        target, block_size=4, num_hidden_layers=1, num_target_features=2, mask_token_id=3
    )
    init = tiny_workspace / "models/init/diverged"
    export_drafter(drafter, init, target.config, torch.float32)
    weights = load_file(init / "model.safetensors")
    weights["fc.weight"][0, 0] = float("nan")
    save_file(weights, init / "model.safetensors")
    monkeypatch.chdir(tiny_workspace)
    capsys.readouterr()  # the target's loading bar
    assert cli.main(["train", "--set", "drafter.init_from=models/init/diverged"]) == 2
    err = capsys.readouterr().err
    assert "weight fc.weight in models/init/diverged/model.safetensors holds 1 NaN" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tiny_workspace / "models/drafter").exists()


def test_another_checkpoint_never_resumes_this_ones_training(tiny_workspace, monkeypatch):
    from dflash.config.params import load_config
    from dflash.stages.train import fingerprint

    monkeypatch.chdir(tiny_workspace)
    init = tiny_workspace / "models/init/first"
    init.mkdir(parents=True)
    (init / "config.json").write_text("{}")
    config = load_config("params.yaml", ["drafter.init_from=models/init/first"])
    before = fingerprint(config)
    assert fingerprint(config) == before
    assert fingerprint(load_config("params.yaml")) != before
    (init / "config.json").write_text("{ }")
    assert fingerprint(config) != before


def test_zero_steps_export_the_imported_drafter_unchanged(tiny_workspace):
    """``train.max_steps: 0`` with ``drafter.init_from``: the export holds the checkpoint's
    weights bit for bit, with its conventions, so evaluate scores it as published."""
    from safetensors.torch import load_file

    from dflash.model.load import load_target

    target = load_target(tiny_workspace / "models/target")
    drafter = DFlashDrafter.from_target(
        target, block_size=4, num_hidden_layers=1, num_target_features=2, mask_token_id=3, seed=7
    )
    init = tiny_workspace / "models/init/published"
    export_drafter(drafter, init, target.config, torch.float32)
    zero = [*SHORT, "train.max_steps=0", "drafter.init_from=models/init/published"]
    run_stages(tiny_workspace, ["stats", "plan", "train"], zero)
    published = load_file(init / "model.safetensors")
    exported = load_file(tiny_workspace / "models/drafter/model.safetensors")
    assert published.keys() == exported.keys()
    for name in published:
        assert torch.equal(published[name], exported[name]), name
    config = json.loads((tiny_workspace / "models/drafter/config.json").read_text())
    source = json.loads((init / "config.json").read_text())
    assert config["block_size"] == source["block_size"]
    for key, value in source["dflash_config"].items():  # layer ids and the mask token's id
        assert config["dflash_config"][key] == value, key
