"""Checkpoints: plain contents loaded with weights_only, and resume only into the same run."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from conftest import run_stages
from safetensors.torch import load_file

from dflash.config.params import load_config
from dflash.model.export import export_drafter
from dflash.pipeline.workspace import Workspace
from dflash.stages.train import fingerprint
from dflash.train.checkpointing import checkpoint
from dflash.train.checkpointing.dcp_safe import SafeReader
from dflash.train.checkpointing.state import TrainState, rng_state, set_rng_state

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

ONE_PROCESS = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1000"]


def test_rng_state_round_trips_through_plain_types():
    state = rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def flip_a_token(workspace) -> None:
    """Change one token id in place: every length, count and the manifest stay the same."""
    tokens = np.memmap(workspace / WS.tokenized / "tokens.bin", dtype=np.uint32, mode="r+")
    tokens[5] = tokens[5] + 1 if tokens[5] < 300 else tokens[5] - 1
    tokens.flush()


def test_fingerprint_covers_token_contents_not_counts(tiny_workspace, monkeypatch):
    monkeypatch.chdir(tiny_workspace)
    config = load_config("params.yaml")
    before = fingerprint(config)
    assert fingerprint(config) == before
    knobs = load_config("params.yaml", ["train.num_workers=3", "train.checkpoint_every=7"])
    assert fingerprint(knobs) == before, "a knob must not start a run over"
    flip_a_token(tiny_workspace)
    assert fingerprint(config) != before
    assert fingerprint(load_config("params.yaml", ["train.lr=1e-3"])) != before


def test_changed_tokens_at_equal_lengths_start_fresh(tiny_workspace, capsys):
    """The stale-resume bug: a finished run must not be resumed after a tokenizer fix."""
    run_stages(tiny_workspace, ["plan", "train"], ONE_PROCESS)
    first = load_file(tiny_workspace / WS.drafter / "model.safetensors")
    (run,) = checkpoint.run_directories(tiny_workspace / WS.checkpoints)
    saved = checkpoint.list_checkpoints(run)
    assert saved, "the run ends with a checkpoint"
    index = SafeReader(saved[0]).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in index} == {
        "train_state",
        "drafter",
        "optimizer",
        "scheduler",
    }

    run_stages(tiny_workspace, ["train"], ONE_PROCESS)
    assert "resumed at epoch 1" in capsys.readouterr().out

    flip_a_token(tiny_workspace)
    run_stages(tiny_workspace, ["train"], ONE_PROCESS)
    out = capsys.readouterr().out
    assert "starting fresh" in out and "resumed" not in out
    again = load_file(tiny_workspace / WS.drafter / "model.safetensors")
    assert any(not torch.equal(first[k], again[k]) for k in first)


class Opaque:
    """Not a tensor nor a plain type: unpickling it could run arbitrary code."""


def test_a_pickled_object_in_a_checkpoint_is_refused(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"x": {"obj": Opaque()}}, "f", keep=3)
    step, skipped = checkpoint.load_latest(tmp_path, "f", {"x": {"obj": None}})
    assert step is None and "unreadable" in skipped[0]


def test_an_index_naming_other_code_is_refused(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, "f", keep=3)
    index = checkpoint.checkpoint_path(tmp_path, 1) / ".metadata"
    index.write_bytes(pickle.dumps(Opaque()))
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        SafeReader(index.parent).read_metadata()


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    for step in (1, 2):
        parts = {"w": torch.full((3,), float(step)), "state": {"step": step}}
        checkpoint.save_checkpoint(tmp_path, step, parts, "f", keep=3)
    newest = checkpoint.checkpoint_path(tmp_path, 2)
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:50])
    into = {"w": torch.zeros(3), "state": {"step": 0}}
    step, skipped = checkpoint.load_latest(tmp_path, "f", into)
    assert step == 1 and into["w"].tolist() == [1.0] * 3 and into["state"]["step"] == 1
    assert "digest mismatch" in skipped[0]
    step, skipped = checkpoint.load_latest(tmp_path, "other-run", into)
    assert step is None and len(skipped) == 2


def test_train_state_round_trips_with_its_rng():
    state = TrainState(epoch=1, global_step=7, epoch_loss=[(0, 1.5, 2.0)], rows=[{"step": 7}])
    saved = state.state_dict()
    draw = torch.rand(1).item()
    fresh = TrainState()
    fresh.load_state_dict(saved)
    assert fresh == state and torch.rand(1).item() == draw


@pytest.mark.parametrize("fail_after", [0, 1])
def test_export_is_whole_or_absent(tmp_path, monkeypatch, fail_after):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "model.safetensors").write_text("old")

    class Drafter:
        def save_pretrained(self, directory, target_config, dtype=None, weights=None):
            (directory / "config.json").write_text("new")
            if fail_after == 0:
                raise KeyboardInterrupt
            (directory / "model.safetensors").write_text("new")
            raise OSError("disk full")

    with pytest.raises((KeyboardInterrupt, OSError)):
        export_drafter(Drafter(), out, target_config=None)
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "config.json": "old",
        "model.safetensors": "old",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_keep_checkpoints_keeps_the_newest_n_with_their_digests(tmp_path):
    for step in (1, 2, 3, 10):
        path = checkpoint.checkpoint_path(tmp_path, step)
        path.mkdir()
        (path / "shard").write_text(str(step))
        path.with_name(path.name + ".sha256").write_text("digest")
    (tmp_path / checkpoint.CHECKPOINT_RUN).write_text("{}")
    (tmp_path / checkpoint.RUN_LOCK).write_text("")
    checkpoint.prune_checkpoints(tmp_path, 2)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [10, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        checkpoint.CHECKPOINT_RUN,
        checkpoint.RUN_LOCK,
        "step_00000003",
        "step_00000003.sha256",
        "step_00000010",
        "step_00000010.sha256",
    ]


def test_saving_a_checkpoint_keeps_the_newest_keep_checkpoints(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))}, "f", 2)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [3, 2]
    into = {"w": torch.zeros(2)}
    assert checkpoint.load_latest(tmp_path, "f", into) == (3, []) and into["w"].tolist() == [3, 3]
