"""The ``capture`` stage: every training sample's target features, written once.

With ``train.features: files`` each sample of the token store gets one file in the format
hs-connectors reads (``hs_<sample id>.safetensors``: ``hidden_states`` ``[T, n, H]`` and
``token_ids``), the format vLLM's connector writes, so training reads them with the same
reader as engine features and runs no target forward: an experiment that changes only
batching or training reuses them. The producer is the target in this process, document by
document, or with ``train.topology: engine`` the serving engines (their files, checked, are
copied in). Features are large (about 40 KB a token at Qwen3-8B with 5 layers), so the stage
logs bytes per token and the projected total before it writes anything. With
``train.features: target`` it writes only the manifest: the pipeline stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.config import Config
from dflash.data.store import TokenStore
from dflash.fileio import atomic_dir
from dflash.model.hidden_states import EngineClient, engine_layer_ids, hidden_transfer
from dflash.model.load import target_device_dtype

logger = logging.getLogger(__name__)

MANIFEST = "features.json"
SAMPLE = "hs_{}.safetensors"
"""hs-connectors' cached-sample name (``FileTransfer.get_cached``)."""


def bytes_per_token(layers: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes a token takes in a file: its states, and its id (int64)."""
    return layers * hidden * dtype.itemsize + 8


def size_line(per_token: int, tokens: int, samples: int) -> str:
    total = per_token * tokens
    return (
        f"{per_token:,} bytes per token x {tokens:,} tokens of {samples:,} samples = "
        f"{total / 1e9:,.3f} GB ({total / 1e12:,.4f} TB)"
    )


def manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def check_capture(path: Path | None, layer_ids: list[int], hidden: int) -> None:
    """``train.features: files`` needs the capture stage's files, of the drafter's layers."""
    from dflash.errors import ConfigError

    if path is None or not (path / MANIFEST).is_file():
        raise ConfigError(f"train.features = files: no {path}/{MANIFEST}; run `dflash capture`")
    info = manifest(path)
    if info["features"] != "files":
        raise ConfigError(
            f"train.features = files: {path} holds only a manifest (captured with "
            f"train.features {info['features']}); run `dflash capture` with train.features files"
        )
    if info["layer_ids"] != layer_ids or info["hidden_size"] != hidden:
        raise ConfigError(
            f"train.features = files: {path} holds layers {info['layer_ids']} of hidden size "
            f"{info['hidden_size']}, the drafter reads {layer_ids} of {hidden}; rerun "
            "`dflash capture`"
        )


def write_sample(directory: Path, sample_id: int, states: torch.Tensor, ids: list[int]) -> None:
    """One sample's file: ``states`` ``[T, n, H]``, as vLLM's connector writes them."""
    tokens = torch.tensor(ids, dtype=torch.int64)
    save_file({"hidden_states": states.contiguous(), "token_ids": tokens},
              directory / SAMPLE.format(sample_id))  # fmt: skip


def capture(
    config: Config, tokenized: Path, target_dir: Path, out: Path, init: Path | None
) -> dict:
    """Write ``out`` whole: the manifest, and with ``train.features: files`` every sample."""
    store = TokenStore(tokenized)
    files, engine = config.train.features == "files", config.train.topology == "engine"
    layer_ids, hidden = target_geometry(config.drafter, target_dir, init)
    dtype = target_device_dtype()[1]
    per_token = bytes_per_token(len(layer_ids), hidden, dtype)
    tokens = int(store.lengths.sum())
    line = size_line(per_token, tokens, len(store))
    logger.info(f"features: {line}" + ("" if files else "; train.features target: not written"))
    info = {
        "features": config.train.features,
        "producer": "engine" if engine else "target",
        "layer_ids": layer_ids,
        "engine_layer_ids": engine_layer_ids(layer_ids),
        "hidden_size": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "samples": len(store) if files else 0,
        "tokens": tokens,
        "bytes_per_token": per_token,
        "projected_bytes": per_token * tokens,
    }
    with atomic_dir(out) as tmp:
        if files:
            produce = _engine(config, layer_ids, hidden, dtype) if engine else None
            if produce is None:
                produce = _target(target_dir, layer_ids, hidden)
            for sample_id in range(len(store)):
                ids = [int(t) for t in store[sample_id][0]]
                states = produce(ids, f"sample {sample_id}")
                write_sample(tmp, sample_id, states.reshape(len(ids), len(layer_ids), hidden), ids)
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _target(target_dir: Path, layer_ids: list[int], hidden: int):
    """One forward of the target in this process per document: what colocated training runs."""
    from dflash.model.features import target_features
    from dflash.model.load import load_target

    device = target_device_dtype()[0]
    target = load_target(target_dir, device=device)
    cuda = device.type == "cuda"  # the training step's autocast: bf16 on CUDA, none on CPU
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def produce(ids: list[int], what: str) -> torch.Tensor:
        row = torch.tensor([ids], device=device)
        positions = torch.arange(len(ids), device=device)[None]
        with torch.inference_mode(), autocast:
            features = target_features(target, row, positions, torch.zeros_like(row), layer_ids)
        return features[0].to(target.get_input_embeddings().weight.dtype).cpu()

    return produce


def _engine(config: Config, layer_ids: list[int], hidden: int, dtype: torch.dtype):
    e = config.engine
    client = EngineClient(
        e.endpoints, hidden_transfer(e.backend), len(layer_ids), hidden, dtype,
        model=e.model, timeout_s=e.timeout_s, max_retries=e.max_retries,
    )  # fmt: skip
    return client.states


def target_geometry(d, target_dir: Path, init: Path | None) -> tuple[list[int], int]:
    """The layers the drafter reads and the target's hidden size, from its config alone."""
    from transformers import AutoConfig

    from dflash.model.load import resolve_target_path
    from dflash.train.init_drafter import tapped_layers

    path = resolve_target_path(target_dir)
    text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    return tapped_layers(d, init, text.num_hidden_layers), text.hidden_size
