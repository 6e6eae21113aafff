"""The capture stage's files are checked before a run trains on them: their sizes, digests,
manifest and target, and a refusal says which params remake them for the run."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shlex
import shutil
import signal
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from conftest import run_stages
from safetensors.torch import load_file, save_file

from dflash.cli import main
from dflash.config.params import apply_override, load_config, set_option
from dflash.data.store import TokenStore
from dflash.errors import OutputError, UserError
from dflash.features.capture import target_geometry
from dflash.features.feature_files import MANIFEST, SAMPLE
from dflash.features.registry import build_features
from dflash.features.source import Inputs
from dflash.model.load import load_target
from dflash.model.objective import objective_of
from dflash.pipeline.declaration import restrict, stages
from dflash.pipeline.workspace import Workspace
from dflash.stages.capture import run as capture_stage
from dflash.stages.train import train_files
from dflash.train.distributed.process_group import Dist
from dflash.train.preflight import preflight
from dflash.train.topology import Placement

pytest.importorskip("hs_connectors")

FILES = "train.features=files"
WS = Workspace()
CPU = Dist(0, 1, 0, torch.device("cpu"))
SAMPLE_3 = SAMPLE.format(3)


@pytest.fixture(scope="module")
def captured(tiny_workspace_template, tmp_path_factory) -> Path:
    """The tiny workspace with every sample's features captured to files, once per module
    (without the held-out τ batch, whose greedy answers cost more than all the rest)."""
    ws = tmp_path_factory.mktemp("captured") / "ws"
    shutil.copytree(tiny_workspace_template, ws)
    (ws / WS.heldout).unlink()
    run_stages(ws, ["capture"], [FILES])
    return ws


@pytest.fixture
def ws(captured, tmp_path, monkeypatch) -> Path:
    """A private copy of ``captured``, the working directory."""
    copy = tmp_path / "ws"
    shutil.copytree(captured, copy)
    monkeypatch.chdir(copy)
    return copy


def train_config(*sets: str):
    """The train stage's params with ``sets``, restricted as ``dflash train`` gets them."""
    stage = stages()["train"]
    return restrict(load_config("params.yaml", [FILES, *sets]), stage.params + stage.knobs)


def fetch(ws: Path, sample_id: int) -> torch.Tensor:
    """Sample ``sample_id``'s states as a files run's drafter rank reads them."""
    config = train_config()
    files = train_files(Workspace(ws), config)
    layer_ids = target_geometry(config.drafter, files.target, None)[0]
    target = load_target(files.target, device="cpu")
    last = objective_of(config).distills
    run = Inputs(config, files, Placement(CPU), target, layer_ids, last, nullcontext(), None)
    features = build_features(run)
    try:
        ids = [int(t) for t in TokenStore(files.tokenized)[sample_id][0]]
        return features.fetch(sample_id, ids, f"sample {sample_id}")
    finally:
        features.close()


def train_cli(ws: Path, capsys, *sets: str) -> tuple[int, str]:
    """``dflash train`` with ``sets`` in ``ws``, its capture record gone (as after ``dvc
    checkout`` restored the files: it proves nothing, so the run's own checks decide)."""
    (ws / ".dflash/provenance/capture.json").unlink(missing_ok=True)
    code = main(["train", *(f"--set={s}" for s in (FILES, *sets))])
    return code, capsys.readouterr().err


def flip(path: Path, count: int = 64) -> None:
    """Flip the lowest bit of ``count`` bytes of the hidden states: still finite, wrong."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    start = 8 + header + json.loads(data[8 : 8 + header])["hidden_states"]["data_offsets"][0]
    data[start : start + count] = bytes(b ^ 1 for b in data[start : start + count])
    path.write_bytes(data)


def test_the_manifest_records_each_file_the_target_and_the_params(captured):
    info = json.loads((captured / WS.features / MANIFEST).read_text())
    names = {SAMPLE.format(i) for i in range(info["samples"])}
    assert set(info["files"]) == names
    for name in (SAMPLE.format(0), SAMPLE_3):
        data = (captured / WS.features / name).read_bytes()
        assert info["files"][name]["bytes"] == len(data)
    assert len(info["target_digest"]) == 64
    assert info["params"]["drafter.num_target_features"] == 2
    assert info["params"]["train.features"] == "files"


def test_a_good_capture_is_read_back_as_written(ws):
    preflight(train_config(), train_files(Workspace(ws), train_config()))
    written = load_file(ws / WS.features / SAMPLE_3)["hidden_states"]
    torch.testing.assert_close(fetch(ws, 3), written.flatten(1), atol=0, rtol=0)


def test_flipped_bytes_in_a_capture_file_stop_the_run_naming_the_file(ws):
    flip(ws / WS.features / SAMPLE_3)
    with pytest.raises(UserError, match=rf"{SAMPLE_3} changed since .*sha256.*dflash capture"):
        fetch(ws, 3)
    fetch(ws, 2)  # the others are read


def change_target(ws: Path) -> None:
    """The target's weights changed on disk, shapes and config kept."""
    path = ws / WS.target / "model.safetensors"
    weights = load_file(path)
    name = next(iter(sorted(weights)))
    weights[name] = weights[name] + 0.01
    save_file(weights, path)


def truncate(ws: Path) -> None:
    path = ws / WS.features / SAMPLE_3
    path.write_bytes(path.read_bytes()[:100])


BROKEN = {
    "truncated": (truncate, rf"{SAMPLE_3} holds 100 bytes, the capture stage wrote \d+: cut"),
    "missing": (lambda ws: (ws / WS.features / SAMPLE_3).unlink(), rf"{SAMPLE_3} does not exist"),
    "malformed manifest": (
        lambda ws: (ws / WS.features / MANIFEST).write_text('{"features": "files",'),
        rf"{MANIFEST} is unreadable \(Expecting",
    ),
    "manifest of no object": (
        lambda ws: (ws / WS.features / MANIFEST).write_text("[1, 2]"),
        rf"{MANIFEST} holds no JSON object",
    ),
    "target changed": (change_target, r"models/target is not the target data/features was"),
}


@pytest.mark.parametrize("cut", ["truncated", "missing"])
def test_a_file_cut_after_the_run_started_stops_it_naming_the_file(ws, cut):
    corrupt, reason = BROKEN[cut]
    corrupt(ws)
    with pytest.raises(UserError, match=reason):
        fetch(ws, 3)


@pytest.mark.parametrize("broken", BROKEN)
def test_broken_capture_files_refuse_the_run_in_one_line_naming_them(ws, capsys, broken):
    corrupt, reason = BROKEN[broken]
    corrupt(ws)
    code, err = train_cli(ws, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith("dflash train: ") and "rerun `dflash capture`" in line
    assert re.search(reason, line), line


@pytest.mark.parametrize(
    ("sets", "made"),
    [
        (["drafter.num_target_features=3"], "drafter.num_target_features = 2"),
        (["objective.loss=kl"], "objective.loss = 'ce'"),
    ],
)
def test_a_refusal_names_the_params_that_capture_what_the_run_reads(ws, capsys, sets, made):
    code, err = train_cli(ws, capsys, *sets)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"it was captured with {made}: rerun `dflash capture --set {sets[0]}`" in err


def test_the_stale_input_message_names_the_set_that_remakes_the_features(ws, capsys):
    code = main(["train", f"--set={FILES}", "--set=drafter.num_target_features=3"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "data/features was made with drafter.num_target_features = 2" in err
    assert (
        "`dflash capture` and the stages after it, given `--set drafter.num_target_features=3`"
        in err
    )


@pytest.mark.parametrize("value", ["files", 3, None, "null", "3", "a: b", [1, 2], {"x": False}])
def test_a_named_set_reads_back_as_the_value(value):
    raw: dict = {}
    apply_override(raw, shlex.split(set_option("section.key", value))[1])
    assert raw == {"section": {"key": value}}


def test_manifest_only_capture_names_train_features(ws, capsys):
    run_stages(ws, ["capture"])  # train.features target: the manifest alone
    code, err = train_cli(ws, capsys)
    assert code == 2, err
    assert "captured with train.features = 'target': rerun `dflash capture " in err
    assert "--set train.features=files`" in err


def test_a_flipped_held_out_batch_is_refused(tmp_path):
    from dflash.features.feature_files import HELDOUT, read_heldout_row, write_file

    row = {"input_ids": torch.arange(12)[None], "features": torch.randn(1, 12, 64)}
    info = {"files": {HELDOUT: write_file(tmp_path, HELDOUT, row)}}
    (tmp_path / MANIFEST).write_text(json.dumps(info))
    got = read_heldout_row(tmp_path, torch.device("cpu"))
    torch.testing.assert_close(got["features"], row["features"], atol=0, rtol=0)
    data = bytearray((tmp_path / HELDOUT).read_bytes())
    data[-1] ^= 1
    (tmp_path / HELDOUT).write_bytes(data)
    with pytest.raises(UserError, match=rf"{HELDOUT} changed since"):
        read_heldout_row(tmp_path, torch.device("cpu"))


def test_a_full_disk_while_capturing_is_one_line_and_leaves_the_old_capture(
    ws, capsys, monkeypatch
):
    before = (ws / WS.features / MANIFEST).read_text()

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    code = main(["capture", f"--set={FILES}"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("dflash capture: cannot write data/features: ENOSPC"), line
    assert "No space left on device" in line
    assert (ws / WS.features / MANIFEST).read_text() == before
    assert not list(ws.glob("data/features.*"))


@contextmanager
def file_size_limit(size: int):
    """The system refuses to grow a file of this process past ``size`` bytes (EFBIG), as a
    full disk refuses a write: a real refusal, whoever writes (Python or a native library)."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_write_the_system_refuses_while_capturing_is_an_output_error(ws):
    stage = stages()["capture"]
    config = restrict(load_config("params.yaml", [FILES]), stage.params + stage.knobs)
    before = (ws / WS.features / MANIFEST).read_text()
    with file_size_limit(2048), pytest.raises(OutputError, match="data/features: EFBIG"):
        capture_stage(config, Workspace())
    assert (ws / WS.features / MANIFEST).read_text() == before
    assert not list(ws.glob("data/features.*"))
