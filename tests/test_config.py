"""params.yaml loading: defaults, overrides, and fail-fast errors that name key and choices."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_committed_params_load():
    config = load_config(ROOT / "params.yaml")
    assert config.batching.strategy in ("sorted", "shuffle", "bucketed", "packed")
    assert config.train.betas == (0.9, 0.95)


def test_override_by_dotted_key():
    config = load_config(
        None, ["batching.strategy=packed", "train.lr=1e-3", "data.max_conversations=null"]
    )
    assert config.batching.strategy == "packed"
    assert config.train.lr == pytest.approx(1e-3)
    assert config.data.max_conversations is None


def test_explicit_boundaries_list():
    assert load_config(None, ["batching.boundaries=[64, 128, 512]"]).batching.boundaries == [
        64,
        128,
        512,
    ]


@pytest.mark.parametrize(
    "override, words",
    [
        ("batching.strategy=random", ["batching.strategy", "'random'", "'sorted'", "'packed'"]),
        ("batching.stratgy=packed", ["batching.stratgy", "allowed", "strategy"]),
        ("trian.epochs=1", ["trian", "allowed", "train"]),
        ("train.epochs=two", ["train.epochs", "'two'", "integer"]),
        ("train.epochs=0", ["train.epochs", ">= 1"]),
        ("data.regenerate=maybe", ["data.regenerate", "true or false"]),
        ("logging.wandb=cloud", ["logging.wandb", "'offline'", "'disabled'"]),
        ("batching.boundaries=[512, 64]", ["batching.boundaries", "increasing"]),
        ("batching.boundaries=best", ["batching.boundaries", "'optimal'"]),
        ("data.source=corpus.csv", ["data.source", ".jsonl"]),
        ("target.hidden_size=130", ["target.hidden_size", "multiple"]),
        ("evaluate.max_new_tokens=1024", ["evaluate.max_new_tokens", "data.max_seq_len"]),
    ],
)
def test_bad_values_fail_fast_with_key_and_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for word in words:
        assert word in str(err.value)


def test_missing_params_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_bad_param_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "plan", "--set", "batching.strategy=zigzag"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "batching.strategy" in proc.stderr and "'bucketed'" in proc.stderr
