"""The openai backend of regenerate against real ``transformers serve`` servers on CPU.

Two servers of the tiny trained target run for the whole module, on free loopback ports.
The corpus is cut to a dozen conversations (24 assistant turns) to keep the module short.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_stages
from local_server import free_port, local_servers

from dflash.cli import main
from dflash.data import regenerate
from dflash.data.conversations import read_conversations, write_conversations
from dflash.data.store import STORE_INDEX
from dflash.errors import ConfigError
from dflash.model import hf_files
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

pytestmark = pytest.mark.slow

ROWS = 12
REGENERATE = [
    "data.regenerate=true",
    "regenerate.max_new_tokens=16",
    "regenerate.shard_size=4",
    "regenerate.batch_size=8",
]


def served(*urls: str, model: str | None = None) -> list[str]:
    """The params that point regenerate at ``urls``."""
    named = [f"regenerate.model={model}"] if model else []
    return [
        *REGENERATE,
        *named,
        "regenerate.backend=openai",
        f"regenerate.endpoints=[{', '.join(urls)}]",
        "regenerate.concurrency=4",
        "regenerate.max_retries=1",
        "regenerate.timeout_s=60",
    ]


@pytest.fixture(scope="module")
def template(tiny_workspace_template, tmp_path_factory):
    """The shared workspace (its target pretrained one epoch), cut to a dozen rows."""
    directory = tmp_path_factory.mktemp("served") / "ws"
    shutil.copytree(tiny_workspace_template, directory)
    rows = read_conversations(directory / WS.conversations)
    write_conversations(rows[:ROWS], directory / WS.conversations)
    return directory


@pytest.fixture(scope="module")
def servers(template, tmp_path_factory):
    with local_servers(template / WS.target, 2, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def runs(template, servers, tmp_path_factory):
    """One workspace regenerated in process, then through both servers."""
    directory = tmp_path_factory.mktemp("runs") / "ws"
    shutil.copytree(template, directory)
    run_stages(directory, ["regenerate"], REGENERATE)
    in_process = read_conversations(directory / WS.regenerated_conversations)
    run_stages(directory, ["regenerate"], served(*(s.url for s in servers)))
    return directory, in_process


def report(workspace) -> dict:
    return json.loads((workspace / WS.regenerate_report).read_text())


def assistant_contents(rows: list[dict]) -> list[str]:
    return [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]


def test_greedy_answers_equal_the_in_process_ones(runs):
    directory, in_process = runs
    through_servers = read_conversations(directory / WS.regenerated_conversations)
    expected = assistant_contents(in_process)
    assert len(expected) == 24
    assert assistant_contents(through_servers) == expected
    stats = report(directory)
    assert stats["turns_regenerated"] > 0 and stats["failed_conversations"] == {}
    assert stats["engine"]["served"]["model"].endswith("models/target")


def test_two_endpoints_share_the_work(runs, servers):
    stats = report(runs[0])
    turns = stats["endpoint_turns"]
    assert sorted(turns) == sorted(s.url for s in servers)
    assert min(turns.values()) > 0
    assert sum(turns.values()) == stats["turns_regenerated"]


def test_the_served_corpus_trains_a_drafter(runs, servers, tmp_path):
    """The rest of the pipeline takes the served corpus: tokenize, plan and one epoch (with
    the params the corpus was regenerated with: its record holds them)."""
    directory = tmp_path / "ws"
    shutil.copytree(runs[0], directory)
    sets = ["data.num_workers=1", "train.world_size=1", "train.epochs=1", "logging.wandb=disabled"]
    sets += served(*(s.url for s in servers))
    run_stages(directory, ["tokenize", "stats", "plan", "train"], sets)
    assert (directory / (WS.tokenized / STORE_INDEX)).exists()
    assert (directory / WS.drafter / hf_files.WEIGHTS).exists()
    assert json.loads((directory / WS.train_metrics).read_text())["steps"] > 0


def test_a_wrong_model_or_an_unreachable_endpoint_exits_2(template, servers, monkeypatch, capsys):
    monkeypatch.chdir(template)
    sets = [f"--set={item}" for item in served(servers[0].url, model="no-such-model")]
    assert main(["regenerate", *sets]) == 2
    assert "not regenerate.model = 'no-such-model'" in capsys.readouterr().err
    sets = [f"--set={item}" for item in served(f"http://127.0.0.1:{free_port()}/v1")]
    assert main(["regenerate", *sets]) == 2
    assert "no answer to GET /models" in capsys.readouterr().err
    assert not (template / WS.regenerated_shards).exists()


def test_a_server_killed_mid_run_loses_nothing(runs, servers, tmp_path, monkeypatch):
    """The second server dies once the first shard is committed; a rerun on the first
    server (endpoints are a knob: the shards stay valid) ends with the same shards."""
    reference = runs[0]
    directory = tmp_path / "ws"
    shutil.copytree(reference, directory)
    shutil.rmtree(directory / WS.regenerated_shards)
    (directory / WS.regenerated_conversations).unlink()
    commit = regenerate.write_json_atomic

    def commit_then_kill(path, value):
        commit(path, value)
        servers[1].stop()

    monkeypatch.setattr(regenerate, "write_json_atomic", commit_then_kill)
    with pytest.raises(ConfigError, match=r"unreachable.*not committed"):
        run_stages(directory, ["regenerate"], served(servers[1].url))
    assert len(list((directory / WS.regenerated_shards).glob("*.json"))) == 1
    monkeypatch.setattr(regenerate, "write_json_atomic", commit)
    run_stages(directory, ["regenerate"], served(servers[0].url))
    assert report(directory)["shards_made"] == report(directory)["shards"] - 1 == 2
    for made in sorted((reference / WS.regenerated_shards).glob("*.parquet")):
        assert (directory / WS.regenerated_shards / made.name).read_bytes() == made.read_bytes()
    regenerated = WS.regenerated_conversations
    assert (directory / regenerated).read_bytes() == (reference / regenerated).read_bytes()
