"""The ``capture`` stage's files: every training sample's target features, written once.

Each sample of the token store has one file in the format hs-connectors reads
(``hs_<sample id>.safetensors``: ``hidden_states`` ``[T, n, H]`` and ``token_ids``), the format
vLLM's connector writes, so training checks them as it checks engine features. Beside them,
the held-out batch simulated τ is measured on (from a target in process) and the manifest.

Training trusts no file it cannot check. The manifest records each file's size and SHA-256,
the target's digest and the params the stage ran with. A run checks the sizes and the target
before it starts (:func:`check_files`) and each file's digest over the bytes it reads anyway
(:class:`CapturedFiles`): a difference exits 2 naming the file or the target, and a refusal
for other params names them as the ``--set`` that captures what this run reads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from dflash.config.params import set_option
from dflash.config.schema import Config
from dflash.errors import ConfigError, UserError
from dflash.features.engine_client import EngineError
from dflash.fileio import not_a_file
from dflash.model.layer_ids import states_per_token
from dflash.model.load import target_digest
from dflash.model.objective import Objective

MANIFEST = "features.json"
SAMPLE = "hs_{}.safetensors"
"""hs-connectors' cached-sample name (``FileTransfer.get_cached``)."""
HELDOUT = "heldout_tau.safetensors"
"""The held-out batch of simulated τ: :func:`dflash.train.simulated.heldout_row`'s packed row."""
DIGEST = "sha256"
"""The digest a file's record in the manifest holds, beside its size in ``bytes``."""
RECAPTURE = "rerun `dflash capture`"


class CaptureError(EngineError, UserError):
    """The capture stage's files are missing, cut short, malformed or changed since it wrote
    them, or of another target: the user remakes them (exit 2). An ``EngineError`` too: as
    with an engine's, a document whose states cannot be had ends the run."""


def manifest(path: Path) -> dict:
    """The stage's ``features.json``; one that is no JSON object is a CaptureError naming it."""
    file = path / MANIFEST
    try:
        info = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CaptureError(f"{file} is unreadable ({err}); {RECAPTURE}") from err
    if not isinstance(info, dict):
        raise CaptureError(f"{file} holds no JSON object; {RECAPTURE}")
    return info


def field(info: dict, key: str, path: Path) -> Any:
    """``info[key]``: a manifest without it is a CaptureError naming the file, no KeyError."""
    if key not in info:
        raise CaptureError(
            f"{path / MANIFEST} has no {key!r}: written by another version of dflash, or "
            f"edited; {RECAPTURE}"
        )
    return info[key]


def check_capture(
    path: Path | None,
    layer_ids: list[int],
    hidden: int,
    last: bool = False,
    config: Config | None = None,
) -> int:
    """``train.features: files`` needs the capture stage's files, of the drafter's layers and,
    where the objective distills (``last``), with the target's last hidden state; returns the
    states a file holds per token. A refusal names the params the capture was made with that
    this run (``config``) has otherwise: :func:`recapture`."""
    if path is None or not (path / MANIFEST).is_file():
        raise ConfigError(f"train.features = files: no {path}/{MANIFEST}; run `dflash capture`")
    info = manifest(path)
    features = field(info, "features", path)
    if features != "files":
        raise ConfigError(
            f"train.features = files: {path} holds only a manifest (captured with "
            f"train.features {features}); "
            + recapture(info, config, f"{RECAPTURE} with train.features files")
        )
    layers, size = field(info, "layer_ids", path), field(info, "hidden_size", path)
    if layers != layer_ids or size != hidden:
        raise ConfigError(
            f"train.features = files: {path} holds layers {layers} of hidden size {size}, "
            f"the drafter reads {layer_ids} of {hidden}; {recapture(info, config)}"
        )
    stored = info.get("last_hidden_state") is True
    if last and not stored:
        raise ConfigError(
            f"objective.loss: kl reads the target's last hidden state, and {path} was captured "
            "without it (with objective.loss ce); "
            + recapture(info, config, f"{RECAPTURE} with this objective.loss")
        )
    return states_per_token(layer_ids, stored)


def recapture(info: dict, config: Config | None, default: str = RECAPTURE) -> str:
    """How to remake the files for this run: ``dflash capture`` with, as ``--set``, each param
    the manifest records that ``config`` holds otherwise (run as it was, the stage would
    remake the same files); ``default`` where none differs."""
    recorded = info.get("params")
    if config is None or not isinstance(recorded, dict):
        return default
    changed = {}
    for key, was in recorded.items():
        now = _param(config, key)
        if now is not _ABSENT and _plain(now) != _plain(was):
            changed[key] = (was, now)
    if not changed:
        return default
    made = ", ".join(f"{key} = {was!r}" for key, (was, _) in changed.items())
    sets = " ".join(set_option(key, now) for key, (_, now) in changed.items())
    return f"it was captured with {made}: rerun `dflash capture {sets}`"


_ABSENT = object()


def _param(config: Config, key: str) -> Any:
    """The dotted ``key`` of ``config`` in JSON types; ``_ABSENT`` where the run holds none."""
    section_name, _, name = key.partition(".")
    section = getattr(config, section_name, None)
    if section is None or name not in section.__dict__:
        return _ABSENT
    return section.model_dump(mode="json", include={name})[name]


def _plain(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def distills(config: Config) -> bool:
    """Whether the files hold the target's last hidden state: the loss reads it (``objective.
    loss`` alone decides, the one objective param the capture stage declares)."""
    return Objective(config.objective.loss).distills


def write_file(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` to ``directory/name``; its record for the manifest (size and digest).

    The bytes are made here and written by Python, so a full disk is an ``OSError`` (ENOSPC)
    that :func:`dflash.fileio.atomic_dir` reports in one line, where safetensors' own writer
    raises an error of its own; and they are hashed without being read back.
    """
    data = save({key: value.contiguous() for key, value in tensors.items()})
    (directory / name).write_bytes(data)
    return {"bytes": len(data), DIGEST: hashlib.sha256(data).hexdigest()}


def write_sample(
    directory: Path, sample_id: int, states: torch.Tensor, ids: list[int]
) -> dict[str, Any]:
    """One sample's file: ``states`` ``[T, n, H]``, as vLLM's connector writes them."""
    tokens = torch.tensor(ids, dtype=torch.int64)
    tensors = {"hidden_states": states, "token_ids": tokens}
    return write_file(directory, SAMPLE.format(sample_id), tensors)


def recorded_files(path: Path, info: dict) -> dict[str, dict]:
    """Each file's record (``bytes`` and ``sha256``) by name, as the manifest holds them."""
    files = field(info, "files", path)
    if not isinstance(files, dict):
        raise CaptureError(f"{path / MANIFEST}: 'files' is no mapping of names; {RECAPTURE}")
    return files


def read_file(directory: Path, name: str, files: dict[str, dict]) -> dict[str, torch.Tensor]:
    """``directory/name``, checked against its record before any of it is used: its bytes are
    read once, hashed, then parsed."""
    path = directory / name
    record = _present(path, files.get(name))
    data = path.read_bytes()
    _same_size(path, len(data), record)
    if hashlib.sha256(data).hexdigest() != record.get(DIGEST):
        raise CaptureError(
            f"{path} changed since the capture stage wrote it (its {DIGEST} differs from the "
            f"one in {MANIFEST}); {RECAPTURE}"
        )
    return load(data)


def _present(path: Path, record: Any) -> dict:
    """``path``'s record, once the file is there: a CaptureError naming it otherwise."""
    if not isinstance(record, dict):
        raise CaptureError(f"{path}: {path.parent / MANIFEST} records no such file; {RECAPTURE}")
    why = not_a_file(path)
    if why:
        raise CaptureError(f"{path} {why}; {RECAPTURE}")
    return record


def _same_size(path: Path, size: int, record: dict) -> None:
    if size != record.get("bytes"):
        raise CaptureError(
            f"{path} holds {size:,} bytes, the capture stage wrote {record.get('bytes')}: cut "
            f"short or changed since; {RECAPTURE}"
        )


class CapturedFiles:
    """The samples' files, each checked against the manifest as it is read: hs-connectors'
    ``FileTransfer.get_cached``, the seam :func:`dflash.features.sources.files.file_fetch`
    reads by."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = recorded_files(directory, manifest(directory))

    def get_cached(self, sample_id: int) -> dict[str, torch.Tensor]:
        return read_file(self.directory, SAMPLE.format(sample_id), self.files)


def check_files(path: Path, samples: int, target: Path) -> None:
    """Before a run starts: the files are of the token store's ``samples``, each there at the
    size the manifest records, and ``target`` is the one they were captured from (contents
    are checked as each file is read)."""
    info = manifest(path)
    captured = field(info, "samples", path)
    if captured != samples:
        raise CaptureError(
            f"{path} holds the features of {captured} samples, the token store has {samples}: "
            f"they were captured from another token store; {RECAPTURE}"
        )
    for name, record in recorded_files(path, info).items():
        file = path / name
        record = _present(file, record)
        _same_size(file, file.stat().st_size, record)
    if field(info, "target_digest", path) != target_digest(target):
        raise CaptureError(
            f"{target} is not the target {path} was captured from (its digest differs from "
            f"the one in {path / MANIFEST}): the target changed since; {RECAPTURE} to capture "
            "this target's features"
        )


def read_heldout_row(directory: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The held-out τ batch the stage wrote, checked, on ``device``; None where it wrote none
    (no held-out prompt, or features from the engines, which write no answers)."""
    files = recorded_files(directory, manifest(directory))
    if HELDOUT not in files:
        return None
    return {k: v.to(device) for k, v in read_file(directory, HELDOUT, files).items()}
