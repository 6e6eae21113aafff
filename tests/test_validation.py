"""Validation on the held-out batch (``train.eval_every``) and the best checkpoint
(``train.keep_best``): the figures against a hand computation, the refusals, and a run that
exports the weights of its best validation."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_stages
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from dflash import cli
from dflash.config.params import load_config
from dflash.errors import ConfigError
from dflash.model.objective import Objective
from dflash.train import simulated
from dflash.train.checkpointing import best, checkpoint
from dflash.train.loop import Trainer
from dflash.train.simulated import SimulatedTau

BLOCKS, BLOCK, VOCAB = 3, 4, 5


class LogitsDrafter(nn.Module):
    """Returns fixed logits as its hidden states, with an identity head: the figures then
    depend only on them."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.hidden = logits.reshape(-1, VOCAB)

    def forward(self, *args):
        return self.hidden[None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def batch(labels: torch.Tensor, counts: torch.Tensor) -> SimulatedTau:
    """A held-out batch of ``labels`` and ``counts``; the drafter stub reads nothing else."""
    empty = torch.zeros(1, 1)
    return SimulatedTau(
        features=empty, context_positions=empty, document_ids=empty, anchors=empty,
        block_ids=empty, block_positions=empty, mask=None, labels=labels, counts=counts,
        autocast=contextlib.nullcontext(),
    )  # fmt: skip


@pytest.fixture
def case():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BLOCKS, BLOCK, VOCAB, generator=generator)
    labels = logits.argmax(-1)
    labels[0, 2] = (labels[0, 2] + 1) % VOCAB  # block 0 misses at slot 2: τ 2
    labels[1, 1] = (labels[1, 1] + 1) % VOCAB  # block 1 misses at slot 1: τ 1
    counts = torch.ones(BLOCKS, BLOCK, dtype=torch.bool)
    counts[:, 0] = False  # the anchor's own slot never counts
    counts[2, 3] = False  # block 2 ends at its document's end: τ 3
    return logits, labels, counts


def by_hand(logits, labels, counts, weight_of) -> tuple[float, float, float]:
    """Weighted CE, accuracy and τ in plain loops over the slots."""
    loss = total = hits = counted = 0.0
    taus = []
    for a in range(BLOCKS):
        weights = weight_of(a)
        accepted, run = 0, True
        for k in range(1, BLOCK):
            if not counts[a, k]:
                run = False
                continue
            row = [float(x) for x in logits[a, k]]
            log_z = math.log(sum(math.exp(x) for x in row))
            loss += weights[k] * (log_z - row[labels[a, k]])
            total += weights[k]
            hit = max(range(VOCAB), key=lambda v: row[v]) == labels[a, k]
            hits, counted = hits + hit, counted + 1
            run = run and hit
            accepted += run
        taus.append(1 + accepted)
    return loss / total, hits / counted, sum(taus) / BLOCKS


def test_decay_weighted_figures_match_a_hand_computation(case):
    logits, labels, counts = case
    gamma = 2.0
    figures = batch(labels, counts).validate(LogitsDrafter(logits), Objective(), gamma)
    decay = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, BLOCK)]
    loss, accuracy, tau = by_hand(logits, labels, counts, lambda a: decay)
    assert figures["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert figures["val_accuracy"] == pytest.approx(accuracy)
    assert accuracy == 6 / 8
    assert figures["val_simulated_tau"] == pytest.approx(tau) == (2 + 1 + 3) / 3


def test_validation_tau_is_the_logged_simulated_tau(case):
    logits, labels, counts = case
    simulated = batch(labels, counts)
    figures = simulated.validate(LogitsDrafter(logits), Objective(), 7.0)
    assert figures["val_simulated_tau"] == simulated.measure(LogitsDrafter(logits))


def test_dpace_weighted_loss_matches_speculators_definition(case):
    logits, labels, counts = case
    alpha = 0.3
    objective = Objective(position_weight="dpace", dpace_alpha=alpha)
    figures = batch(labels, counts).validate(LogitsDrafter(logits), objective, 7.0)
    probs = logits.double().softmax(-1).gather(-1, labels[..., None])[..., 0]

    def dpace(a: int) -> list[float]:
        """w_k = sum over counted t >= k of the product over counted j <= t of s_j."""
        smooth = [(1 - alpha) * float(probs[a, j]) + alpha for j in range(BLOCK)]
        reach = [math.prod(smooth[j] for j in range(t + 1) if counts[a, j]) for t in range(BLOCK)]
        return [
            sum(reach[t] for t in range(k, BLOCK) if counts[a, t]) if counts[a, k] else 0.0
            for k in range(BLOCK)
        ]

    loss, _, _ = by_hand(logits, labels, counts, dpace)
    assert figures["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_label_log_probs_in_pieces_are_log_softmax(monkeypatch):
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(7) % VOCAB
    whole = logits.log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    monkeypatch.setattr(simulated, "LOGITS_PER_CHUNK", 2 * VOCAB)  # 2 rows a piece
    assert torch.allclose(simulated.label_log_probs(logits, labels), whole)


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        (["train.keep_best=true"], ["train.keep_best", "train.eval_every"]),
        (["train.eval_every=-1"], ["train.eval_every"]),
        (
            ["train.eval_every=5", "train.topology=engine", "engine.endpoints=[http://h:1/v1]"],
            ["train.eval_every"],
        ),
    ],
)
def test_refused_combinations_name_the_keys(sets, keys):
    with pytest.raises(ConfigError) as refused:
        load_config("params.yaml", sets)
    assert all(key in str(refused.value) for key in keys), str(refused.value)


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        (["train.keep_best=true"], ["train.keep_best", "train.eval_every"]),
        (
            ["train.eval_every=2", "train.topology=engine", "engine.endpoints=[http://h:1/v1]"],
            ["train.eval_every"],
        ),
    ],
)
def test_the_command_line_refuses_them_with_exit_2(tmp_path, monkeypatch, capsys, sets, keys):
    monkeypatch.chdir(tmp_path)
    params = str(Path(__file__).parents[1] / "params.yaml")
    assert cli.main(["train", "--params", params, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert all(key in err for key in keys) and "Traceback" not in err, err


def test_keep_best_with_validation_loads():
    config = load_config("params.yaml", ["train.eval_every=5", "train.keep_best=true"])
    assert (config.train.eval_every, config.train.keep_best) == (5, True)
    files = load_config("params.yaml", ["train.eval_every=5", "train.features=files"])
    assert files.train.eval_every == 5  # capture files hold the held-out batch
    defaults = load_config("params.yaml", [])
    assert (defaults.train.eval_every, defaults.train.keep_best) == (0, False)


SETS = ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1", "train.max_steps=9"]
SETS += ["train.eval_every=2", "train.keep_best=true"]
"""A pilot of 9 steps: validated at 2, 4, 6, 8 and at the last step, 9."""


def script_taus(monkeypatch, taus: dict[int, float]) -> dict[int, dict]:
    """Make each validation's τ ``taus[step]`` (the tiny drafter's is 1.0 throughout), its
    loss and accuracy measured; returns the drafter's weights at each validation."""
    weights, current = {}, {}
    validate_step, validate = Trainer._validate, SimulatedTau.validate

    def noting_step(self, step):
        current["step"] = step
        return validate_step(self, step)

    def scripted(self, drafter, objective, gamma):
        state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        weights[current["step"]] = state
        figures = validate(self, drafter, objective, gamma)
        return figures | {"val_simulated_tau": taus[current["step"]]}

    monkeypatch.setattr(Trainer, "_validate", noting_step)
    monkeypatch.setattr(SimulatedTau, "validate", scripted)
    return weights


def kept_files(workspace) -> list:
    (run,) = checkpoint.run_directories(workspace / "checkpoints")
    return sorted((run / best.DIRECTORY).glob("step_*"))


def assert_exported(workspace, weights: dict) -> None:
    exported = load_file(workspace / "models/drafter/model.safetensors")
    assert exported.keys() <= weights.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, weights[name].to(tensor.dtype)), name


@pytest.mark.slow
def test_keep_best_exports_the_best_validation(tiny_workspace, monkeypatch):
    taus = {2: 1.0, 4: 1.5, 6: 1.2, 8: 1.5, 9: 1.1}  # best at 4, tied at 8: the earlier wins
    seen = script_taus(monkeypatch, taus)
    run_stages(tiny_workspace, ["plan", "train"], SETS)
    rows = list(csv.DictReader(open(tiny_workspace / "plots/train/log.csv")))
    validated = [row for row in rows if row["val_simulated_tau"]]
    assert [int(row["step"]) for row in validated] == list(taus)
    assert [float(row["val_simulated_tau"]) for row in validated] == list(taus.values())
    for row in validated:
        assert 0.0 <= float(row["val_accuracy"]) <= 1.0
        assert float(row["val_loss"]) > 0.0
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert (details["best_step"], details["best_val_simulated_tau"]) == (4, 1.5)
    card = (tiny_workspace / "models/drafter/README.md").read_text()
    assert "| best_step | 4 |" in card
    (kept,) = kept_files(tiny_workspace)
    with safe_open(kept, "pt") as f:
        assert f.metadata()["step"] == "4"
    assert_exported(tiny_workspace, load_file(kept))
    assert_exported(tiny_workspace, seen[4])
    last = seen[9]
    assert any(not torch.equal(seen[4][name], last[name]) for name in seen[4])


class Interrupted(Exception):
    """Stands for a kill just before a checkpoint is written."""


@pytest.mark.slow
def test_a_killed_keep_best_run_resumes_to_the_same_export(
    tiny_workspace, tmp_path, monkeypatch, capsys
):
    """Killed after keeping step 4's weights but before its checkpoint: the run resumes at
    step 3, whose best is step 2, and ends with what an uninterrupted run exports."""
    script_taus(monkeypatch, {2: 1.0, 4: 1.5, 6: 1.2, 8: 1.7, 9: 1.1})
    run_stages(tiny_workspace, ["plan"], SETS)
    resumed = tmp_path / "resumed"
    shutil.copytree(tiny_workspace, resumed)
    run_stages(tiny_workspace, ["train"], SETS)
    whole = load_file(tiny_workspace / "models/drafter/model.safetensors")
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert (details["best_step"], details["best_val_simulated_tau"]) == (8, 1.7)

    save = checkpoint.save_checkpoint

    def die_before_four(directory, step, *args, **kwargs):
        if step == 4:
            raise Interrupted
        save(directory, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", die_before_four)
    with pytest.raises(Interrupted):
        run_stages(resumed, ["train"], SETS)
    assert [p.name for p in kept_files(resumed)] == [
        "step_00000002.safetensors", "step_00000004.safetensors"
    ]  # fmt: skip
    capsys.readouterr()
    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    run_stages(resumed, ["train"], SETS)
    assert "resumed at epoch 0 step 3" in capsys.readouterr().out
    again = json.loads((resumed / "metrics/train_details.json").read_text())
    assert (again["best_step"], again["best_val_simulated_tau"]) == (8, 1.7)
    assert [p.name for p in kept_files(resumed)] == ["step_00000008.safetensors"]
    exported = load_file(resumed / "models/drafter/model.safetensors")
    assert whole.keys() == exported.keys()
    for name in whole:
        assert torch.equal(whole[name], exported[name]), name
