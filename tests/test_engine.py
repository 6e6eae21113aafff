"""Features from serving engines and from the capture stage's files equal colocated ones."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import run_stages
from engine_server import FAULTS, StandInEngine, aux_states
from local_server import free_port
from run_outputs import assert_same_drafter, logged

from dflash import cli
from dflash.config.schema import Config
from dflash.errors import ConfigError
from dflash.features import engine_client
from dflash.features.documents import DocumentFeatures
from dflash.features.engine_client import EngineClient, EngineError, hidden_transfer
from dflash.features.feature_files import MANIFEST, check_capture, read_heldout_row
from dflash.features.sources.engine import served_fetch
from dflash.features.sources.files import file_fetch
from dflash.features.target_forward import target_features
from dflash.model.layer_ids import engine_layer_ids
from dflash.pipeline.workspace import Workspace
from dflash.train.batches import micro_batch_shape
from dflash.train.distributed.process_group import Dist

pytest.importorskip("hs_connectors")

LAYERS = [1, 3]
"""The drafter's layers of the 6-layer tiny target: outputs of layers 1 and 3."""
TINY_TARGET = {"num_hidden_layers": 6}
"""The module's ``target`` (conftest.py): :func:`tiny_qwen3` of these keywords."""
CPU = Dist(0, 1, 0, torch.device("cpu"))
WS = Workspace()


class Documents:
    """A token store's read side: ``store[sample_id] -> (ids, loss mask)``."""

    def __init__(self, docs: list[list[int]]) -> None:
        self.docs = docs

    def __getitem__(self, sample_id: int):
        ids = np.array(self.docs[sample_id], dtype=np.uint32)
        return ids, np.ones_like(ids, dtype=np.uint8)


@pytest.fixture
def engine(target, tmp_path):
    with StandInEngine(target, engine_layer_ids(LAYERS), tmp_path / "hs") as server:
        yield server


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """Retries at once: the tests count attempts, not how long they wait between them."""
    monkeypatch.setattr(engine_client, "BACKOFF_S", 0.0)


def client(
    *endpoints: str, directory: Path, retries: int = 0, timeout_s: float = 30.0
) -> EngineClient:
    return EngineClient(
        list(endpoints), hidden_transfer("file", directory), len(LAYERS), 32, torch.float32,
        timeout_s=timeout_s, max_retries=retries,
    )  # fmt: skip


def documents(n: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(5, 290, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def micro_batch(rows, docs):
    """The micro-batch tensors of ``rows`` (``(sample, offset, length)`` per document)."""
    shape = micro_batch_shape(rows)
    ids, doc_ids, pos = (torch.zeros(shape, dtype=torch.long) for _ in range(3))
    doc_ids -= 1
    for r, row in enumerate(rows):
        for d, (sample, offset, length) in enumerate(row):
            ids[r, offset : offset + length] = torch.tensor(docs[sample])
            doc_ids[r, offset : offset + length] = d
            pos[r, offset : offset + length] = torch.arange(length)
    return ids, pos, doc_ids


class Batch:
    def __init__(self, input_ids):
        self.input_ids = input_ids


def planned(docs):
    """Two micro-batches: padded rows, then packed rows of several documents."""
    lengths = [len(d) for d in docs]
    padded = [[(0, 0, lengths[0])], [(1, 0, lengths[1])]]
    packed = [[(2, 0, lengths[2]), (3, lengths[2], lengths[3])], [(4, 0, lengths[4])]]
    return [[padded], [packed]]


def test_vllms_aux_states_of_the_engine_layer_ids_are_the_colocated_features(target):
    """The convention, pinned against vLLM's definition (the stand-in's ``aux_states``: the
    residual stream entering aux layer j), not against Hugging Face's hidden_states list:
    colocated features are layer i's output, so the engine is asked for i + 1."""
    assert engine_layer_ids(LAYERS) == [2, 4]
    ids = documents(1)[0]
    t = torch.tensor([ids])
    ours = target_features(target, t, torch.arange(t.shape[1])[None], t * 0, LAYERS)
    served = aux_states(target, ids, engine_layer_ids(LAYERS)).flatten(1)
    torch.testing.assert_close(served, ours[0], atol=1e-6, rtol=0)
    embedded = target.get_input_embeddings()(t)[0]  # aux layer 0: what enters the first layer
    torch.testing.assert_close(aux_states(target, ids, [0])[:, 0], embedded, atol=0, rtol=0)


def test_engine_features_equal_colocated_features_padded_and_packed(target, engine, tmp_path):
    docs = documents()
    second = StandInEngine(target, engine_layer_ids(LAYERS), engine.directory)
    with second:
        served = client(engine.url, second.url, directory=engine.directory)
        features = DocumentFeatures(
            served_fetch(served), Documents(docs), CPU, 64, torch.float32, prefetch=1, workers=4,
            forwards=lambda: served.requests,
        )  # fmt: skip
        steps = planned(docs)
        features.epoch([step for step in steps], 0)
        for step in steps:
            ids, pos, doc_ids = micro_batch(step[0], docs)
            got = features(Batch(ids))
            want = target_features(target, ids, pos, doc_ids, LAYERS)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert features.finish()["target_forwards"] == len(docs)
    assert engine.requests > 0 and second.requests > 0
    assert not list((tmp_path / "hs").iterdir()), "every file read once, then removed"


REASONS = {
    "http500": "BadStates: HTTP 500",
    "slow": "TimeoutError",
    "trickle": "TimeoutError: no whole answer within 0.5 s",
    "garbage": "BadStatusLine",
    "bad_json": "the answer is not JSON",
    "no_params": "no kv_transfer_params",
    "missing": "no hidden-states file",
    "truncated": "is unreadable: SafetensorError",
    "shape": "hidden_states have shape (",
    "dtype": "hidden_states have dtype torch.float16, expected torch.float32",
    "stale": "other tokens",
    "zeros": "all zero",
    "nan": "NaN",
}
"""The reason each fault of the stand-in must be named by."""


def test_every_fault_has_its_reason():
    assert set(REASONS) == set(FAULTS)


@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_is_retried_then_ends_the_run_naming_endpoint_and_micro_batch(engine, fault):
    docs = documents(1)
    engine.faults.extend([fault] * 2)
    flaky = client(engine.url, directory=engine.directory, retries=1, timeout_s=0.5)
    features = DocumentFeatures(
        served_fetch(flaky), Documents(docs), CPU, 64, torch.float32, prefetch=1, workers=1
    )
    features.epoch([[[[(0, 0, len(docs[0]))]]]], 0)
    with pytest.raises(EngineError) as err:
        features(Batch(torch.zeros((1, len(docs[0])), dtype=torch.long)))
    message = str(err.value)
    assert engine.url in message and "micro-batch 0 of drafter rank 0" in message
    assert "2 attempts" in message and REASONS[fault] in message, message
    assert "\n" not in message


def test_a_fault_then_a_good_answer_trains_on_the_good_one(target, engine):
    docs = documents(1)
    engine.faults.extend(["stale"])
    states = client(engine.url, directory=engine.directory, retries=1).states(docs[0], "0")
    ids = torch.tensor([docs[0]])
    want = target_features(target, ids, torch.arange(ids.shape[1])[None], ids * 0, LAYERS)[0]
    torch.testing.assert_close(states, want, atol=1e-5, rtol=0)


def test_a_server_that_is_down_is_named(tmp_path):
    down = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EngineError, match=down.replace(".", r"\.")):
        client(down, directory=tmp_path, retries=1).states(
            [5, 6, 7], "micro-batch 3 of drafter rank 1, sample 9"
        )


class Watched:
    """A file transfer that records every path it is asked to read or delete."""

    def __init__(self, directory: Path) -> None:
        self.inner = hidden_transfer("file", directory)
        self.hidden_states_path = self.inner.hidden_states_path
        self.touched: list[str] = []

    def get_generated(self, params):
        self.touched.append(str(params["hidden_states_path"]))
        return self.inner.get_generated(params)

    def delete(self, handle: str) -> None:
        self.touched.append(handle)
        self.inner.delete(handle)


HOSTILE = {
    "the drafter's weights": lambda ws: str(ws / "models/drafter/model.safetensors"),
    "a system file": lambda ws: "/etc/passwd",
    "a relative path up": lambda ws: "../../models/drafter/model.safetensors",
    "an absolute path up": lambda ws: (
        f"{ws}/data/hidden_states/../../models/drafter/model.safetensors"
    ),
    "a link out": lambda ws: "link.safetensors",
    "the directory itself": lambda ws: ".",
    "an integer": lambda ws: 12345,
    "a list": lambda ws: [str(ws / "models/drafter/model.safetensors")],
}
"""``hidden_states_path`` answers naming what the client must never read nor delete."""


@pytest.mark.parametrize("name", HOSTILE)
def test_a_path_outside_the_states_directory_is_refused_never_read_nor_deleted(
    target, tmp_path, name
):
    """The drafter's weights hold, byte for byte, the states asked for (an answer the checks
    would pass): only where the file lies refuses it."""
    ws, doc = tmp_path / "ws", documents(1)[0]
    directory = ws / "data/hidden_states"
    directory.mkdir(parents=True)
    weights = ws / "models/drafter/model.safetensors"
    weights.parent.mkdir(parents=True)
    states = aux_states(target, doc, engine_layer_ids(LAYERS))
    StandInEngine._write(weights, states, torch.tensor(doc), None)
    (directory / "link.safetensors").symlink_to(weights)
    before = weights.read_bytes()
    handle = HOSTILE[name](ws)
    watched = Watched(directory)
    with StandInEngine(target, engine_layer_ids(LAYERS), directory) as engine:
        engine.faults.append({"hidden_states_path": handle})
        asking = EngineClient([engine.url], watched, len(LAYERS), 32, torch.float32, max_retries=0)
        with pytest.raises(EngineError) as err:
            asking.states(doc, "sample 0")
    assert repr(handle) in str(err.value) and "refused" in str(err.value)
    assert watched.touched == [] and weights.read_bytes() == before
    assert (directory / "link.safetensors").is_symlink()


def test_only_files_inside_the_states_directory_are_read_then_deleted(target, engine):
    """A relative name is of the directory; the file the client read is gone after."""
    doc = documents(1)[0]
    name = "relative.safetensors"
    states = aux_states(target, doc, engine_layer_ids(LAYERS))
    StandInEngine._write(engine.directory / name, states, torch.tensor(doc), None)
    engine.faults.append({"hidden_states_path": name})
    watched = Watched(engine.directory)
    asking = EngineClient([engine.url], watched, len(LAYERS), 32, torch.float32, max_retries=0)
    assert asking.states(doc, "sample 0").shape == (len(doc), 64)
    inside = str((engine.directory / name).resolve())
    assert watched.touched == [inside, inside] and not (engine.directory / name).exists()


def test_capture_from_an_engine_that_is_down_ends_in_one_line_naming_it(
    tiny_workspace, monkeypatch, capsys
):
    from dflash.cli import main

    down = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.chdir(tiny_workspace)
    sets = ["train.features=files", "train.topology=engine", f"engine.endpoints=[{down}]"]
    code = main(["capture", *(f"--set={s}" for s in [*sets, "engine.max_retries=0"])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"{down}: ConnectionRefusedError" in err and "sample 0" in err
    assert not (tiny_workspace / WS.features).exists()


def test_a_missing_or_stale_capture_file_ends_the_run_naming_the_sample(target, tmp_path):
    from dflash.features.feature_files import write_sample

    docs = documents(2)
    states = torch.randn(len(docs[0]), 2, 32)
    write_sample(tmp_path, 0, states, docs[0])
    other = [t + 1 for t in docs[1]]  # another document of the same length: a stale file
    write_sample(tmp_path, 1, torch.randn(len(docs[1]), 2, 32), other)
    fetch = file_fetch(hidden_transfer("file", tmp_path), 2, 32, torch.float32, tmp_path)
    torch.testing.assert_close(fetch(0, docs[0], "sample 0"), states.reshape(len(docs[0]), 64))
    with pytest.raises(EngineError, match="sample 1: .*other tokens"):
        fetch(1, docs[1], "sample 1")
    with pytest.raises(EngineError, match="sample 2: .*no hidden-states file"):
        fetch(2, docs[1], "sample 2")


def test_files_need_the_capture_of_the_drafters_layers(tmp_path):
    with pytest.raises(ConfigError, match="run `dflash capture`"):
        check_capture(tmp_path, LAYERS, 32)
    (tmp_path / MANIFEST).write_text(json.dumps({"features": "target"}))
    with pytest.raises(ConfigError, match="only a manifest"):
        check_capture(tmp_path, LAYERS, 32)
    info = {"features": "files", "layer_ids": [1, 2], "hidden_size": 32}
    (tmp_path / MANIFEST).write_text(json.dumps(info))
    with pytest.raises(ConfigError, match=r"the drafter reads \[1, 3\]"):
        check_capture(tmp_path, LAYERS, 32)


def test_kl_from_files_needs_the_last_hidden_state_and_ce_reads_past_it(tmp_path):
    info = {"features": "files", "layer_ids": LAYERS, "hidden_size": 32}
    (tmp_path / MANIFEST).write_text(json.dumps(info))
    assert check_capture(tmp_path, LAYERS, 32) == 2
    with pytest.raises(ConfigError, match=r"objective.loss.*rerun `dflash capture`"):
        check_capture(tmp_path, LAYERS, 32, last=True)
    (tmp_path / MANIFEST).write_text(json.dumps(info | {"last_hidden_state": True}))
    assert check_capture(tmp_path, LAYERS, 32, last=True) == 3
    from dflash.features.feature_files import write_sample

    doc = documents(1)[0]
    states = torch.randn(len(doc), 3, 32)
    write_sample(tmp_path, 0, states, doc)
    transfer = hidden_transfer("file", tmp_path)
    for keep in (2, 3):
        fetch = file_fetch(transfer, 3, 32, torch.float32, tmp_path, keep)
        torch.testing.assert_close(fetch(0, doc, "sample 0"), states[:, :keep].flatten(1))


def test_engine_params_are_checked(tmp_path):
    with pytest.raises(ValueError, match="engine.endpoints"):
        Config.model_validate({"train": {"topology": "engine"}})
    with pytest.raises(ValueError, match="train.features"):
        Config.model_validate({"train": {"topology": "decoupled", "features": "files"}})
    kl = {"objective": {"loss": "kl"}}
    Config.model_validate(kl | {"train": {"features": "files"}})
    with pytest.raises(ValueError, match="objective.loss"):
        Config.model_validate(
            kl | {"train": {"topology": "engine"}, "engine": {"endpoints": ["http://h/v1"]}}
        )
    with pytest.raises(ConfigError, match="mooncake"):
        hidden_transfer("mooncake", tmp_path)


# ------------------------------------------------------------------ training end to end
def train(workspace: Path, *overrides: str) -> dict:
    """``dflash train`` on one rank, which trains in the launching process: here, this one."""
    run_stages(workspace, ["train"], overrides)
    return json.loads((workspace / WS.train_details).read_text())


@pytest.mark.slow
def test_training_from_the_engine_and_from_capture_files_trains_the_colocated_drafter(
    tiny_workspace_template, tmp_path
):
    from dflash.data.tokenizer import load_tokenizer
    from dflash.model.load import load_target
    from dflash.train.simulated import heldout_row as heldout_batch

    base = tmp_path / "colocated"
    shutil.copytree(tiny_workspace_template, base)
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"] |= {"world_size": 1, "epochs": 1, "max_steps": 6}
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    run_stages(base, ["plan"])
    served, files = tmp_path / "engine", tmp_path / "files"
    shutil.copytree(base, served)
    shutil.copytree(base, files)
    reference = train(base)
    assert reference["target_forwards"] > 0

    target = load_target(base / WS.target, device="cpu")
    states = served / WS.hidden_states  # the client's directory in that workspace
    with StandInEngine(target, engine_layer_ids(LAYERS), states) as engine:
        details = train(served, "train.topology=engine", f"engine.endpoints=[{engine.url}]")
    assert_same_drafter(base, served)
    assert details["target_forwards"] == engine.requests > 0

    run_stages(files, ["capture"], ["train.features=files"])
    info = json.loads((files / WS.features / MANIFEST).read_text())
    assert info["bytes_per_token"] == 2 * 32 * 4 + 8 and info["samples"] > 0
    assert info["simulated_tau"] and not info["last_hidden_state"]
    details = train(files, "train.features=files")
    assert_same_drafter(base, files)
    assert details["target_forwards"] == 0
    tau = logged(base, "simulated_tau")
    assert tau and logged(files, "simulated_tau") == pytest.approx(tau, abs=1e-9, rel=0)
    # The whole held-out batch, not only τ (an untrained drafter's is 1 on any batch).
    made = heldout_batch(
        base / WS.heldout, target, load_tokenizer(base / WS.tokenizer), LAYERS,
        params["data"]["max_seq_len"], contextlib.nullcontext(),
        params["data"].get("chat_template_kwargs", {}),
    )  # fmt: skip
    stored = read_heldout_row(files / WS.features, torch.device("cpu"))
    assert stored.keys() == made.keys()
    for key, value in made.items():
        torch.testing.assert_close(stored[key], value, atol=0, rtol=0)


@pytest.mark.slow
def test_kl_from_capture_files_trains_the_colocated_kl_drafter(
    tiny_workspace_template, tmp_path, monkeypatch, capsys
):
    base = tmp_path / "colocated"
    shutil.copytree(tiny_workspace_template, base)
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["train"] |= {"world_size": 1, "epochs": 1, "max_steps": 4}
    params["objective"] = {**params.get("objective", {}), "loss": "kl"}
    (base / "params.yaml").write_text(yaml.safe_dump(params))
    run_stages(base, ["plan"])
    files = tmp_path / "files"
    shutil.copytree(base, files)
    train(base)

    run_stages(files, ["capture"], ["train.features=files", "objective.loss=ce"])
    monkeypatch.chdir(files)
    assert cli.main(["train", "--set=train.features=files"]) == 2
    refused = capsys.readouterr().err
    assert "objective.loss" in refused and "dflash capture" in refused, refused[-2000:]

    run_stages(files, ["capture"], ["train.features=files"])
    info = json.loads((files / WS.features / MANIFEST).read_text())
    assert info["last_hidden_state"] and info["bytes_per_token"] == 3 * 32 * 4 + 8
    assert train(files, "train.features=files")["target_forwards"] == 0
    assert_same_drafter(base, files)
