"""Optimizer and schedule choices: each schedule against its formula, Muon's parameter split,
and the combinations refused."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from conftest import interrupted_after, run_stages, tiny_drafter, tiny_qwen3
from safetensors.torch import load_file

from dflash.config.params import load_config
from dflash.config.schema import TrainConfig
from dflash.errors import ConfigError
from dflash.train.checkpointing import checkpoint
from dflash.train.checkpointing.dcp_safe import SafeReader
from dflash.train.optim import Optimization, decay_steps, muon_split, warmup_steps

TOTAL, PEAK = 40, 1.0e-3


def reference(schedule: str, step: int, warmup: int, total: int, decay: int) -> float:
    """The multiplier of the peak rate at ``step``, written out from each schedule's definition."""
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    stable_end = total - decay  # wsd
    if step < stable_end:
        return 1.0
    return max(0.0, 1 - (step - stable_end) / max(1, decay)) if step < total else 0.0


def rates(t: TrainConfig, total: int = TOTAL) -> list[float]:
    """The rate of every step of a run of ``total`` steps, read as the loop reads it."""
    model = torch.nn.Linear(3, 3)
    optim = Optimization.build(model, t, total, fused=False)
    out = []
    for _ in range(total):
        out.append(optim.lr)
        optim.schedule_step()
    return out


WARMUPS = [{"warmup_ratio": 0.1}, {"warmup_steps": 7}, {"warmup_ratio": 0}]


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "linear", "constant"])
@pytest.mark.parametrize("warmup", WARMUPS)
def test_each_schedule_follows_its_formula(schedule, warmup):
    t = TrainConfig(lr=PEAK, schedule=schedule, decay_ratio=0.25, **warmup)
    w = warmup_steps(t, TOTAL)
    assert w == warmup.get("warmup_steps", math.ceil(warmup.get("warmup_ratio", 0) * TOTAL))
    decay = decay_steps(0.25, w, TOTAL)
    expected = [PEAK * reference(schedule, s, w, TOTAL, decay) for s in range(TOTAL)]
    assert rates(t) == pytest.approx(expected, abs=1e-15)


def test_wsd_holds_the_peak_then_decays_over_its_share():
    got = rates(TrainConfig(lr=PEAK, schedule="wsd", warmup_steps=4, decay_ratio=0.25))
    assert got[4:30] == [PEAK] * 26 and got[30] == PEAK and got[31] < PEAK
    assert got[-1] == pytest.approx(PEAK / 10)


def test_default_schedule_is_transformers_cosine_with_the_ratio_rounded_up():
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters(), lr=PEAK)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(0.04 * TOTAL), TOTAL)
    expected = []
    for _ in range(TOTAL):
        expected.append(scheduler.get_last_lr()[0])
        scheduler.step()
    assert rates(TrainConfig(lr=PEAK)) == expected  # bitwise: the default run is unchanged


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
    drafter = tiny_drafter(tiny_qwen3(), mask_token_id=0)
    muon, adamw = muon_split(drafter)
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert muon and all(p.ndim == 2 and names[id(p)].startswith("layers.") for p in muon)
    assert {names[id(p)] for p in adamw} >= {"fc.weight", "norm.weight", "hidden_norm.weight"}
    assert all(not (p.ndim == 2 and names[id(p)].startswith("layers.")) for p in adamw)
    assert len(muon) + len(adamw) == len(list(drafter.parameters()))
    optim = Optimization.build(drafter, TrainConfig(optimizer="muon"), TOTAL, fused=False)
    assert [type(o).__name__ for o in optim.optimizers] == ["Muon", "AdamW"]
    assert len(optim.schedulers) == 2


def test_muon_steps_follow_the_schedule():
    drafter = tiny_drafter(tiny_qwen3(), mask_token_id=0)
    optim = Optimization.build(drafter, TrainConfig(optimizer="muon", lr=PEAK), 10, fused=False)
    for _ in range(3):
        optim.schedule_step()
    assert {g["lr"] for o in optim.optimizers for g in o.param_groups} == {optim.lr}


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (["train.optimizer=muon", "train.parallelism=fsdp"], "train.optimizer"),
        (["train.schedule=step"], "train.schedule"),
    ],
)
def test_refused_combinations_name_the_key(sets, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("params.yaml", sets)


@pytest.mark.slow
def test_muon_trains_and_resumes_exactly(tiny_workspace, tmp_path, monkeypatch, capsys):
    sets = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1"]
    sets += ["train.optimizer=muon", "train.schedule=wsd", "train.warmup_steps=1"]
    run_stages(tiny_workspace, ["plan"], sets)
    resumed = tmp_path / "resumed"
    shutil.copytree(tiny_workspace, resumed)
    run_stages(tiny_workspace, ["train"], sets)
    whole = load_file(tiny_workspace / "models/drafter/model.safetensors")

    with interrupted_after(monkeypatch, 3):
        run_stages(resumed, ["train"], sets)
    (run,) = checkpoint.run_directories(resumed / "checkpoints")
    index = SafeReader(checkpoint.list_checkpoints(run)[0]).read_metadata().state_dict_metadata
    assert any("momentum_buffer" in key for key in index), "Muon's state is checkpointed"
    capsys.readouterr()
    run_stages(resumed, ["train"], sets)
    assert "resumed at epoch 0 step 3" in capsys.readouterr().out
    again = load_file(resumed / "models/drafter/model.safetensors")
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
