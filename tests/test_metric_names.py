"""The names a run writes are declared once (:mod:`dflash.metrics.names`), those of its
metrics files checked against their models before training, and each producer writes exactly
its list."""

from types import SimpleNamespace

import pytest
import torch

from dflash.metrics import names as metric_names
from dflash.metrics.names import PLOT_COLUMNS, SERIES, SUMMARY, MetricNameError
from dflash.train.checkpointing.state import TrainState
from dflash.train.loop import Trainer, _Window
from dflash.train.observe.monitor import Monitor
from dflash.train.topology import ColocatedFeatures


def test_the_declared_names_fit_the_files_they_end_up_in():
    metric_names.check()


@pytest.mark.parametrize(
    "patch, named",
    [
        ({"SUMMARY": {**SUMMARY, "the export": ("drafter_sha265",)}}, "drafter_sha265"),
        ({"SUMMARY": {**SUMMARY, "the export": ()}}, "requires 'drafter_sha256'"),
        ({"TRAINING_KEYS": ("final_los",)}, "final_los"),
    ],
)
def test_a_misspelt_name_is_refused_before_the_trainer_loads_anything(monkeypatch, patch, named):
    for attribute, value in patch.items():
        monkeypatch.setattr(metric_names, attribute, value)
    with pytest.raises(MetricNameError, match=named):
        Trainer(None, None, None, None)  # nothing to load: the check comes first


def _result() -> dict:
    return {
        "finite": True, "loss": 1.0, "weight": 2.0, "correct": torch.tensor([4, 3, 2]),
        "counted": torch.tensor([4, 4, 4]), "real_tokens": 10, "padded_tokens": 12,
        "n_samples": 2, "grad_norm": 0.5, "lr": 1e-3,
    }  # fmt: skip


def test_each_producer_writes_exactly_its_declared_names():
    window = _Window()
    window.add(_result(), seconds=1.0, wait=0.1, length_class="short")
    assert {*window.row(step=1, epoch=0), "simulated_tau"} == {*PLOT_COLUMNS, *SERIES}

    trainer = SimpleNamespace(
        state=TrainState(), simulated=None, plan_tokens=0, timed=[], total_steps=1,
        config=SimpleNamespace(train=SimpleNamespace(epochs=1)),
        ctx=SimpleNamespace(world_size=1), drafter_sources=None,
    )  # fmt: skip
    assert list(Trainer._summary(trainer)) == list(SUMMARY["Trainer._summary"])

    balance = ColocatedFeatures(torch.nn.Identity(), []).finish()
    assert list(balance) == list(SUMMARY["the feature source's finish()"])

    history = {"loss": [], "grad_norm": [], "mean_length": []}
    figures = Monitor.stability(SimpleNamespace(history=history))
    assert list(figures) == list(SUMMARY["Monitor.stability"])
