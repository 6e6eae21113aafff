"""The ``capture`` stage's work: every training sample's target features, written once.

With ``train.features: files`` each sample of the token store gets one file
(:mod:`dflash.features.feature_files`), so training runs no target forward: an experiment that
changes only batching or training reuses them. The producer is the target in this process,
document by document, or with ``train.topology: engine`` the serving engines (their files,
checked, are copied in). Features are large (about 40 KB a token at Qwen3-8B with 5 layers),
so the stage logs bytes per token and the projected total before it writes anything. With
``train.features: target`` it writes only the manifest: the pipeline stays cheap.

Two more things a files run would otherwise need a target for come with the files from the
target in process. The held-out batch simulated τ is measured on (:mod:`dflash.train.
simulated`: the target's own answers and its features), so a files run logs the τ a colocated
run logs. And, when ``objective.loss`` distills, the target's last hidden state after the
drafter's layers in every sample's file (``last_hidden_state`` in the manifest), which the KL
to the target reads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.features.engine_client import connect
from dflash.features.feature_files import (
    HELDOUT,
    MANIFEST,
    SAMPLE,
    distills,
    write_file,
    write_sample,
)
from dflash.fileio import atomic_dir
from dflash.model.drafter import drafter_autocast
from dflash.model.layer_ids import engine_layer_ids, states_per_token
from dflash.model.load import target_device_dtype, target_digest

logger = logging.getLogger(__name__)


def bytes_per_token(layers: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes a token takes in a file: its states, and its id (int64)."""
    return layers * hidden * dtype.itemsize + 8


def size_line(per_token: int, tokens: int, samples: int) -> str:
    total = per_token * tokens
    return (
        f"{per_token:,} bytes per token x {tokens:,} tokens of {samples:,} samples = "
        f"{total / 1e9:,.3f} GB ({total / 1e12:,.4f} TB)"
    )


def capture(
    config: Config,
    tokenized: Path,
    target_dir: Path,
    out: Path,
    init: Path | None,
    heldout: Path | None = None,
    tokenizer: Path | None = None,
    params: dict[str, Any] | None = None,
    states: Path | None = None,
) -> dict:
    """Write ``out`` whole: the manifest, and with ``train.features: files`` every sample (and
    from the target in process, the held-out τ batch from ``heldout`` with ``tokenizer``).
    The manifest records ``params`` (the stage's, dotted), the target's digest and each
    file's size and digest, which training checks. From engines, their files are read in
    ``states``."""
    store = TokenStore(tokenized)
    files = config.train.features == "files"
    layer_ids, hidden = target_geometry(config.drafter, target_dir, init)
    dtype = target_device_dtype()[1]
    last = distills(config)  # the KL reads the last hidden state after the layers
    stored = states_per_token(layer_ids, last)
    per_token = bytes_per_token(stored, hidden, dtype)
    tokens = int(store.lengths.sum())
    line = size_line(per_token, tokens, len(store))
    logger.info(f"features: {line}" + ("" if files else "; train.features target: not written"))
    info = {
        "features": config.train.features,
        "producer": "engine" if config.train.topology == "engine" else "target",
        "layer_ids": layer_ids,
        "engine_layer_ids": engine_layer_ids(layer_ids),
        "hidden_size": hidden,
        "dtype": str(dtype).removeprefix("torch."),
        "samples": len(store) if files else 0,
        "tokens": tokens,
        "bytes_per_token": per_token,
        "projected_bytes": per_token * tokens,
        "target_digest": target_digest(target_dir),
        "params": params or {},
    }
    with atomic_dir(out) as tmp:
        if files:
            produce, row = _producer(
                config, target_dir, layer_ids, hidden, last, heldout, tokenizer, states
            )
            written = {} if row is None else {HELDOUT: write_file(tmp, HELDOUT, _cpu(row))}
            for sample_id in range(len(store)):
                ids = [int(t) for t in store[sample_id][0]]
                states = produce(ids, f"sample {sample_id}")
                shaped = states.reshape(len(ids), stored, hidden)
                written[SAMPLE.format(sample_id)] = write_sample(tmp, sample_id, shaped, ids)
            info |= {"last_hidden_state": last, "simulated_tau": row is not None}
            info["files"] = written
        (tmp / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _cpu(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.cpu() for key, value in row.items()}


def _producer(config, target_dir, layer_ids, hidden, last, heldout, tokenizer, states):
    """What makes each sample's states, and the held-out τ batch (None from the engines)."""
    if config.train.topology == "engine":
        return _engine(config, layer_ids, hidden, target_device_dtype()[1], states), None
    target = _load(target_dir)
    row = _heldout_row(config, target, layer_ids, heldout, tokenizer)
    return _target(target, layer_ids, last), row


def _load(target_dir: Path):
    from dflash.model.load import load_target

    return load_target(target_dir, device=target_device_dtype()[0])


def _target(target, layer_ids: list[int], last: bool):
    """One forward of the target in this process per document: what colocated training runs."""
    from dflash.features.target_forward import feature_dtype, target_features

    device = target.get_input_embeddings().weight.device
    autocast = drafter_autocast(device)

    def produce(ids: list[int], what: str) -> torch.Tensor:
        row = torch.tensor([ids], device=device)
        positions = torch.arange(len(ids), device=device)[None]
        with torch.inference_mode(), autocast:
            features = target_features(
                target, row, positions, torch.zeros_like(row), layer_ids, last=last
            )
        return features[0].to(feature_dtype(target)).cpu()

    return produce


def _heldout_row(
    config: Config, target, layer_ids: list[int], heldout: Path | None, tokenizer: Path | None
) -> dict[str, torch.Tensor] | None:
    """The held-out τ batch, made as a colocated run makes it (None without held-out prompts)."""
    from dflash.data.tokenizer import load_tokenizer
    from dflash.train.simulated import heldout_row

    if heldout is None or tokenizer is None or not heldout.is_file():
        return None
    device = target.get_input_embeddings().weight.device
    d = config.data
    return heldout_row(
        heldout, target, load_tokenizer(tokenizer), layer_ids, d.max_seq_len,
        drafter_autocast(device), dict(d.chat_template_kwargs),
    )  # fmt: skip


def _engine(
    config: Config, layer_ids: list[int], hidden: int, dtype: torch.dtype, states: Path | None
):
    return connect(config.engine, states, len(layer_ids), hidden, dtype).states


def target_geometry(d, target_dir: Path, init: Path | None) -> tuple[list[int], int]:
    """The layers the drafter reads and the target's hidden size, from its config alone."""
    from transformers import AutoConfig

    from dflash.model.target_dir import resolve_target_path
    from dflash.train.init_drafter import tapped_layers

    path = resolve_target_path(target_dir)
    text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    return tapped_layers(d, init, text.num_hidden_layers), text.hidden_size
