"""params.yaml loading: defaults, overrides, and fail-fast errors that name key and choices."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash.config.params import load_config
from dflash.config.schema import Config
from dflash.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_committed_params_load():
    config = load_config(ROOT / "params.yaml")
    assert config.batching.strategy in ("sorted", "shuffle", "bucketed", "packed")
    assert config.train.betas == (0.9, 0.95)
    assert config.export.dtype == "auto"


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
        ("data.turns=per_message", ["data.turns", "'auto'", "'per_turn'"]),
        (
            "data.special_tokens_in_content=strip",
            ["data.special_tokens_in_content", "'drop'", "'escape'", "'keep'"],
        ),
        ("target.hidden_size=130", ["target.hidden_size", "multiple"]),
        ("evaluate.max_new_tokens=1024", ["evaluate.max_new_tokens", "data.max_seq_len"]),
        ("train.lr=.nan", ["train.lr", "nan", "finite"]),
        ("train.clip_grad=.inf", ["train.clip_grad", "inf", "finite"]),
        ("train.betas=[5, -1]", ["train.betas[0]", "5.0", "[0, 1)"]),
        ("train.betas=[0.9, 1.0]", ["train.betas[1]", "1.0", "[0, 1)"]),
        ("train.weight_decay=-0.1", ["train.weight_decay", "-0.1", ">= 0"]),
        ("train.seed=-1", ["train.seed", "-1", ">= 0"]),
        ("target.num_attention_heads=0", ["target.num_attention_heads", "0", ">= 1"]),
        ("target.intermediate_size=-4", ["target.intermediate_size", "-4", ">= 1"]),
        ("batching.boundaries=[-5, 64]", ["batching.boundaries", "-5", "positive"]),
        ("batching.token_budget=256", ["batching.token_budget", "256", "data.max_seq_len"]),
        ("data.source=/tmp/corpus.jsonl", ["data.source", "data/raw"]),
        ("data.source=data/raw/../x.jsonl", ["data.source", "data/raw"]),
        ("train.lr=[1", ["--set", "not valid YAML"]),
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


def cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "dflash.cli", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    "text, words",
    [
        (None, ["params.yaml", "does not exist"]),
        ("", ["params.yaml", "empty"]),
        ("# only a comment\n", ["params.yaml", "empty"]),
        ("train:\n  lr: [1, 2\n", ["params.yaml", "line", "not valid YAML"]),
        ("train:\n  lr: .nan\n", ["train.lr", "nan", "finite"]),
        ("- a list\n", ["params.yaml", "mapping"]),
    ],
)
def test_params_file_errors_exit_2_without_traceback(tmp_path, text, words):
    if text is not None:
        (tmp_path / "params.yaml").write_text(text)
    proc = cli(tmp_path, "ingest")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in proc.stderr


def test_a_missing_source_file_exits_2(tmp_path):
    (tmp_path / "params.yaml").write_text("data:\n  source: data/raw/gone.jsonl\n")
    proc = cli(tmp_path, "ingest")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data/raw/gone.jsonl" in proc.stderr


def test_cli_reports_bad_param_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "plan", "--params", str(ROOT / "params.yaml")]
        + ["--set", "batching.strategy=zigzag"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "batching.strategy" in proc.stderr and "'bucketed'" in proc.stderr


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=.nan", "train.lr"),
        ("train.betas=[5, -1]", "train.betas[0]"),
        ("target.num_attention_heads=0", "target.num_attention_heads"),
        ("batching.token_budget=100", "batching.token_budget"),
        ("train.epochs=0", "train.epochs"),
    ],
)
def test_out_of_domain_values_exit_2_through_the_cli(tmp_path, override, key):
    proc = cli(tmp_path, "train", "--params", str(ROOT / "params.yaml"), "--set", override)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert key in proc.stderr
    assert "must" in proc.stderr or "finite" in proc.stderr


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "batching:\n  strategy: packed\nbatching:\n  seed: 1\n",
            ["params.yaml", "line 3", "'batching'", "twice"],
        ),
        ("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", ["params.yaml", "line 3", "'lr'", "twice"]),
        (b"data:\n  source: caf\xe9.jsonl\n", ["params.yaml", "not UTF-8"]),
        ("batching:\n  max_batch_size: " + str(10**29) + "\n", ["batching.max_batch_size", "<="]),
        ("batching:\n  token_budget: " + str(10**29) + "\n", ["batching.token_budget", "<="]),
    ],
)
def test_hostile_params_files_exit_2_with_the_key(tmp_path, text, words):
    """A key given twice, bytes that are not UTF-8 and integers beyond 32 bits: exit 2 naming
    where, never the last key silently winning, a traceback or an overflow later."""
    path = tmp_path / "params.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    proc = cli(tmp_path, "plan")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr


def test_a_key_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match="twice"):
        load_config(None, ["batching.boundaries={a: 1, a: 2}"])


def alias_bomb() -> str:
    """Ten lines whose aliases of aliases expand to 9**10 strings."""
    lines = ["data:", "  chat_template_kwargs:", "    a: &a [" + ", ".join(["x"] * 9) + "]"]
    for prev, name in zip("abcdefghi", "bcdefghij", strict=True):
        lines.append(f"    {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_exits_2_naming_the_line(tmp_path):
    (tmp_path / "params.yaml").write_text(alias_bomb())
    with pytest.raises(ConfigError, match=r"params.yaml: line 4, column 12: YAML alias \*a"):
        load_config(tmp_path / "params.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.cli", "tokenize"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "line 4" in proc.stderr and "alias *a is not allowed" in proc.stderr


def test_an_alias_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"--set .*YAML alias \*x is not allowed"):
        load_config(None, ["data.chat_template_kwargs={a: &x [1], b: *x}"])


def test_a_params_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path)


def test_the_code_defaults_are_params_yaml():
    """One set of defaults: a Config built in Python trains what `dvc repro` trains."""
    import yaml

    committed = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    assert Config().model_dump(mode="json") == committed
