"""Checkpoints: plain contents loaded with weights_only, and resume only into the same run."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from conftest import run_stages
from safetensors.torch import load_file

from dflash import paths
from dflash.model.export import export_drafter
from dflash.params import load_config
from dflash.train import checkpoint

ONE_PROCESS = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1000"]


def test_rng_state_round_trips_through_plain_types():
    state = checkpoint.rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def flip_a_token(workspace) -> None:
    """Change one token id in place: every length, count and the manifest stay the same."""
    tokens = np.memmap(workspace / paths.TOKENIZED / "tokens.bin", dtype=np.uint32, mode="r+")
    tokens[5] = tokens[5] + 1 if tokens[5] < 300 else tokens[5] - 1
    tokens.flush()


def test_fingerprint_covers_token_contents_not_counts(tiny_workspace):
    os.chdir(tiny_workspace)
    config = load_config("params.yaml")
    before = checkpoint.run_fingerprint(config)
    assert checkpoint.run_fingerprint(config) == before
    knobs = load_config("params.yaml", ["train.num_workers=3", "train.checkpoint_every=7"])
    assert checkpoint.run_fingerprint(knobs) == before, "a knob must not start a run over"
    flip_a_token(tiny_workspace)
    assert checkpoint.run_fingerprint(config) != before
    assert checkpoint.run_fingerprint(load_config("params.yaml", ["train.lr=1e-3"])) != before


def test_changed_tokens_at_equal_lengths_start_fresh(tiny_workspace, capsys):
    """The stale-resume bug: a finished run must not be resumed after a tokenizer fix."""
    run_stages(tiny_workspace, ["plan", "train"], ONE_PROCESS)
    first = load_file(tiny_workspace / paths.DRAFTER / "model.safetensors")
    saved = checkpoint.list_checkpoints(tiny_workspace / paths.CHECKPOINTS)
    assert saved, "the run ends with a checkpoint"
    state = torch.load(saved[0], map_location="cpu", weights_only=True)
    assert set(state) == {"fingerprint", "drafter", "optimizer", "scheduler", "state", "rng"}

    run_stages(tiny_workspace, ["train"], ONE_PROCESS)
    assert "resumed at epoch 1" in capsys.readouterr().out

    flip_a_token(tiny_workspace)
    run_stages(tiny_workspace, ["train"], ONE_PROCESS)
    out = capsys.readouterr().out
    assert "starting fresh" in out and "resumed" not in out
    again = load_file(tiny_workspace / paths.DRAFTER / "model.safetensors")
    assert any(not torch.equal(first[k], again[k]) for k in first)


class Opaque:
    """Not a tensor nor a plain type: unpickling it could run arbitrary code."""


def test_a_pickled_object_in_a_checkpoint_is_refused(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"fingerprint": "f", "x": Opaque()}, keep=3)
    state, skipped = checkpoint.load_latest(tmp_path, "f")
    assert state is None and "unreadable" in skipped[0]


@pytest.mark.parametrize("fail_after", [0, 1])
def test_export_is_whole_or_absent(tmp_path, monkeypatch, fail_after):
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "model.safetensors").write_text("old")

    class Drafter:
        def save_pretrained(self, directory, target_config):
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
