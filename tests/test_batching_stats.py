"""Stage ``stats`` and the ``stats`` → ``plan`` wiring through the real stage functions."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.batching import io
from dflash.batching.length_stats import describe, main
from dflash.batching.validate import validate_plans
from dflash.config.params import from_dict
from dflash.data.store import STORE_INDEX
from dflash.pipeline.workspace import Workspace
from dflash.stages.plan import run as plan_run
from dflash.stages.stats import run as stats_run


def lengths_for_test(n: int = 3000) -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.clip(rng.lognormal(4.5, 0.8, n), 2, 256).astype(np.int32)


def test_describe():
    lengths = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    d = describe(lengths)
    assert d["count"] == 10 and d["total_tokens"] == 55 and d["min"] == 1 and d["max"] == 10
    assert d["mean"] == 5.5 and d["quantiles"]["p50"] == 5.5
    assert d["token_mass_by_decile"] == pytest.approx([i / 55 for i in range(1, 11)])
    assert sum(d["histogram"]["counts"]) == 10


def test_cli_writes_every_output(tmp_path):
    lengths_file = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"length": lengths_for_test()}), lengths_file)
    args = ["--lengths", str(lengths_file), "--num-buckets", "4", "--token-budget", "2048"]
    assert main([*args, "--out", str(tmp_path / "stats")]) == 0
    names = sorted(p.name for p in (tmp_path / "stats").iterdir())
    assert names == ["buckets.json", "histogram.csv", "lengths.json", "lengths.png"]
    buckets = json.loads((tmp_path / "stats" / "buckets.json").read_text())
    assert set(buckets) == {"optimal", "quantile", "token_mass"}
    for entry in buckets.values():
        assert len(entry["boundaries"]) <= 4
        assert 0 < entry["predicted_efficiency"] <= buckets["optimal"]["predicted_efficiency"]
        assert 0 < entry["simulated_efficiency"] <= 1


def test_stage_functions_plan_the_token_index(tmp_path):
    ws = Workspace(tmp_path)  # the stages read and write under it, whatever the cwd
    lengths = lengths_for_test()
    (ws.tokenized / STORE_INDEX).parent.mkdir(parents=True)
    index = {
        "sample_id": np.arange(lengths.size),
        "offset": np.cumsum(lengths) - lengths,
        "length": lengths,
        "n_loss_tokens": lengths // 2,
        "conversation_id": [f"c{i}" for i in range(lengths.size)],
    }
    pq.write_table(pa.table(index), (ws.tokenized / STORE_INDEX))
    config = from_dict(
        {
            "data": {"max_seq_len": 256},
            "batching": {"strategy": "bucketed", "token_budget": 2048, "boundaries": "quantile"},
            "train": {"epochs": 2, "world_size": 2, "grad_accum": 2},
        }
    )
    stats_run(config, ws)
    plan_run(config, ws)
    summary = validate_plans(ws.plans, lengths)
    buckets = json.loads((ws.stats / "buckets.json").read_text())
    assert summary["meta"]["boundaries"] == buckets["quantile"]["boundaries"]
    assert summary["meta"]["world_size"] == 2 and summary["meta"]["epochs"] == 2
    assert all(
        not isinstance(v, dict | list) for k, v in summary.items() if k not in {"epochs", "meta"}
    )
    assert io.read_epoch(io.epoch_path(ws.plans, 1))[1] == summary["meta"]
    metrics = json.loads(ws.plan_metrics.read_text())
    assert metrics["padding_efficiency"] == summary["padding_efficiency"] and "meta" not in metrics
