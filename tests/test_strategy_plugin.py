"""A batching strategy added as one module of an installed package: the params accept it, the
planner plans with it, ``plan validate`` holds it to its own expectations and training runs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_stages

from dflash.batching.choices import strategy_names
from dflash.batching.errors import InvalidPlanError
from dflash.batching.planner import main
from dflash.batching.validate import validate_plans
from dflash.config.doc import render
from dflash.config.params import load_config

TOY = '''"""``toy``: shortest first, the same micro-batches every epoch."""

import numpy as np

from dflash.batching.layout import one_sample_rows
from dflash.batching.strategy import Strategy


def layout(lengths, params, rng):
    order = np.argsort(lengths, kind="stable")
    return one_sample_rows(order, lengths, params.token_budget, params.max_batch_size)


STRATEGY = Strategy(name="toy", layout=layout, doc="shortest first, frozen", frozen=True)
'''

LIAR = '''"""``liar``: a new order every epoch, though it says its micro-batches are frozen."""

from dflash.batching.layout import one_sample_rows
from dflash.batching.strategy import Strategy


def layout(lengths, params, rng):
    order = rng.permutation(lengths.size)
    return one_sample_rows(order, lengths, params.token_budget, params.max_batch_size)


STRATEGY = Strategy(name="liar", layout=layout, doc="random, claims frozen", frozen=True)
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """``toy_strategies`` on ``sys.path``, declared as an installed package would declare it."""
    site = tmp_path / "site"
    (site / "toy_strategies").mkdir(parents=True)
    (site / "toy_strategies/__init__.py").write_text("")
    (site / "toy_strategies/toy.py").write_text(TOY)
    (site / "toy_strategies/liar.py").write_text(LIAR)
    info = site / "toy_strategies-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-strategies\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dflash.batching.strategies]\ntoy = toy_strategies.toy\nliar = toy_strategies.liar\n"
    )
    monkeypatch.syspath_prepend(str(site))
    yield "toy"
    for name in ("toy_strategies.toy", "toy_strategies.liar", "toy_strategies"):
        sys.modules.pop(name, None)


def test_a_plugin_strategy_plans_and_validates(toy, tmp_path):
    assert toy in strategy_names() and "`toy`: shortest first, frozen" in render()
    assert load_config(None, [f"batching.strategy={toy}"]).batching.strategy == toy
    lengths = np.random.default_rng(0).integers(1, 64, 200).astype(np.int32)
    lengths_file = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"length": lengths}), lengths_file)
    plans = tmp_path / "plans"
    args = ["--lengths", str(lengths_file), "--strategy", toy, "--token-budget", "256"]
    args += ["--max-seq-len", "64", "--max-batch-size", "8", "--epochs", "2", "--out", str(plans)]
    assert main(args) == 0
    assert main(["validate", str(plans), "--lengths", str(lengths_file)]) == 0
    assert json.loads((plans / "summary.json").read_text())["frozen_batch_fraction"] == 1.0

    liar = tmp_path / "liar"
    assert main([*args[:3], "liar", *args[4:-1], str(liar)]) == 0
    with pytest.raises(InvalidPlanError, match="'liar' must keep every micro-batch"):
        validate_plans(liar, lengths)


@pytest.mark.slow
def test_a_plugin_strategy_trains(toy, tiny_workspace):
    sets = [f"batching.strategy={toy}", "batching.token_budget=3072", "batching.max_batch_size=64"]
    sets += ["train.world_size=1", "train.epochs=1", "train.checkpoint_every=1000"]
    sets += ["logging.every=1000"]
    run_stages(tiny_workspace, ["stats", "plan", "train"], sets)
    summary = json.loads((tiny_workspace / "data/plans/summary.json").read_text())
    assert summary["meta"]["strategy"] == toy
    metrics = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    assert metrics["steps"] == summary["n_steps"] >= 1
    assert np.isfinite(metrics["final_loss"])
