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

Two more things a files run would otherwise need a target for come with the files from the
target in process. The held-out batch simulated τ is measured on (:mod:`dflash.train.
simulated`: the target's own answers and its features), so a files run logs the τ a colocated
run logs. And, when ``objective.loss`` distills, the target's last hidden state after the
drafter's layers in every sample's file (``last_hidden_state`` in the manifest), which the KL
to the target reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.config import Config
from dflash.data.store import TokenStore
from dflash.errors import ConfigError
from dflash.fileio import atomic_dir
from dflash.model.distill import Objective
from dflash.model.hidden_states import EngineClient, engine_layer_ids, hidden_transfer
from dflash.model.load import target_device_dtype

logger = logging.getLogger(__name__)

MANIFEST = "features.json"
SAMPLE = "hs_{}.safetensors"
"""hs-connectors' cached-sample name (``FileTransfer.get_cached``)."""
HELDOUT = "heldout_tau.safetensors"
"""The held-out batch of simulated τ: :func:`dflash.train.simulated.capture`'s packed row."""


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


def check_capture(path: Path | None, layer_ids: list[int], hidden: int, last: bool = False) -> int:
    """``train.features: files`` needs the capture stage's files, of the drafter's layers and,
    where the objective distills (``last``), with the target's last hidden state; returns the
    states a file holds per token."""
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
    stored = info.get("last_hidden_state", False)
    if last and not stored:
        raise ConfigError(
            f"objective.loss: kl reads the target's last hidden state, and {path} was captured "
            "without it (with objective.loss ce); rerun `dflash capture` with this objective.loss"
        )
    return len(layer_ids) + stored


def distills(config: Config) -> bool:
    """Whether the files must hold the target's last hidden state: the objective reads it."""
    return Objective(config.objective.loss).distills


def heldout_row(directory: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The held-out τ batch the stage wrote, on ``device``; None where it wrote none (no
    held-out prompt, or features from the engines, which write no answers)."""
    path = directory / HELDOUT
    return {k: v.to(device) for k, v in load_file(path).items()} if path.is_file() else None


def write_sample(directory: Path, sample_id: int, states: torch.Tensor, ids: list[int]) -> None:
    """One sample's file: ``states`` ``[T, n, H]``, as vLLM's connector writes them."""
    tokens = torch.tensor(ids, dtype=torch.int64)
    save_file({"hidden_states": states.contiguous(), "token_ids": tokens},
              directory / SAMPLE.format(sample_id))  # fmt: skip


def capture(
    config: Config,
    tokenized: Path,
    target_dir: Path,
    out: Path,
    init: Path | None,
    heldout: Path | None = None,
    tokenizer: Path | None = None,
) -> dict:
    """Write ``out`` whole: the manifest, and with ``train.features: files`` every sample (and
    from the target in process, the held-out τ batch from ``heldout`` with ``tokenizer``)."""
    store = TokenStore(tokenized)
    files, engine = config.train.features == "files", config.train.topology == "engine"
    layer_ids, hidden = target_geometry(config.drafter, target_dir, init)
    dtype = target_device_dtype()[1]
    last = distills(config)
    stored = len(layer_ids) + last
    per_token = bytes_per_token(stored, hidden, dtype)
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
    if files:
        info |= {"last_hidden_state": last, "simulated_tau": False}
    with atomic_dir(out) as tmp:
        if files:
            if engine:
                produce = _engine(config, layer_ids, hidden, dtype)
            else:
                target = _load(target_dir)
                produce = _target(target, layer_ids, last)
                row = _heldout_row(config, target, layer_ids, heldout, tokenizer)
                if row is not None:
                    save_file({k: v.contiguous().cpu() for k, v in row.items()}, tmp / HELDOUT)
                info["simulated_tau"] = row is not None
            for sample_id in range(len(store)):
                ids = [int(t) for t in store[sample_id][0]]
                states = produce(ids, f"sample {sample_id}")
                write_sample(tmp, sample_id, states.reshape(len(ids), stored, hidden), ids)
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _load(target_dir: Path):
    from dflash.model.load import load_target

    return load_target(target_dir, device=target_device_dtype()[0])


def _autocast(device: torch.device):
    """The training step's autocast: bf16 on CUDA, none on CPU."""
    cuda = device.type == "cuda"
    return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()


def _target(target, layer_ids: list[int], last: bool):
    """One forward of the target in this process per document: what colocated training runs."""
    from dflash.model.features import target_features

    device = target.get_input_embeddings().weight.device
    autocast = _autocast(device)

    def produce(ids: list[int], what: str) -> torch.Tensor:
        row = torch.tensor([ids], device=device)
        positions = torch.arange(len(ids), device=device)[None]
        with torch.inference_mode(), autocast:
            features = target_features(
                target, row, positions, torch.zeros_like(row), layer_ids, last=last
            )
        return features[0].to(target.get_input_embeddings().weight.dtype).cpu()

    return produce


def _heldout_row(
    config: Config, target, layer_ids: list[int], heldout: Path | None, tokenizer: Path | None
) -> dict[str, torch.Tensor] | None:
    """The held-out τ batch, made as a colocated run makes it (None without held-out prompts)."""
    from dflash.data.tokenizer import load_tokenizer
    from dflash.train.simulated import capture as simulated_batch

    if heldout is None or tokenizer is None or not heldout.is_file():
        return None
    device = target.get_input_embeddings().weight.device
    d = config.data
    return simulated_batch(
        heldout, target, load_tokenizer(tokenizer), layer_ids, d.max_seq_len,
        _autocast(device), dict(d.chat_template_kwargs),
    )  # fmt: skip


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

    from dflash.model.target_dir import resolve_target_path
    from dflash.train.init_drafter import tapped_layers

    path = resolve_target_path(target_dir)
    text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    return tapped_layers(d, init, text.num_hidden_layers), text.hidden_size
