"""The one way every stage after ``target`` loads the frozen target (a leaf: no pretraining).

``models/target/`` holds either the tiny default in full or a reference file that points at
a real model directory; both load here, frozen, in eval mode and in the device's dtype. A
sharded run loads it in shards (:func:`load_target_shards`): each rank reads only its own
rows of each weight, so no rank holds the whole target in host memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from dflash.model.target_dir import resolve_target_path, weight_files
from dflash.pipeline.fingerprint import digest, path_digest

logger = logging.getLogger(__name__)


def target_device_dtype() -> tuple[torch.device, torch.dtype]:
    """bf16 on CUDA, where the target's matmuls are fast in it; fp32 on CPU, where it is not."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_target(
    path_or_dir: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """Load the target frozen and in eval mode, in ``dtype`` or the one that suits ``device``."""
    device = torch.device(device) if device is not None else target_device_dtype()[0]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_target_path(path_or_dir), dtype=dtype, local_files_only=True
    )
    model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model


def model_directory(path: str) -> Path:
    """The local directory of a resolved target path: itself, or a hub id's cached snapshot."""
    if Path(path).is_dir():
        return Path(path)
    return Path(snapshot_download(path, local_files_only=True))


def shard_start(size: int, world: int, rank: int) -> int:
    """First row of ``rank``'s shard of ``size`` rows: FSDP's ``torch.chunk`` split."""
    return min(rank * math.ceil(size / world), size)


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None, int]:
    """The tensor this rank stores, the dimension it is sharded on (None: whole) and its start."""
    if not isinstance(tensor, DTensor):
        return tensor, None, 0
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim != 1 or not isinstance(placements[0], Shard):
        raise ValueError(f"cannot load a tensor placed as {placements} on a {mesh.ndim}-d mesh")
    dim = placements[0].dim
    start = shard_start(tensor.shape[dim], mesh.size(), mesh.get_local_rank())
    return tensor.to_local(), dim, start


def read_rows(path: Path, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file, or only its rows ``start:start+length`` of ``dim``.

    The file is opened for this one tensor: its pages are mapped into the process while it is
    open, so a handle kept across tensors would keep every row read so far resident too.
    """
    with safe_open(path, framework="pt") as handle:
        if dim is None:
            return handle.get_tensor(name)
        stored = handle.get_slice(name)
        index = [slice(None)] * len(stored.get_shape())
        index[dim] = slice(start, start + length)
        return stored[tuple(index)]


def file_tensors(model: nn.Module) -> dict[str, list[str]]:
    """Each tensor a checkpoint stores (parameters, persistent buffers), by its names.

    Tied weights are one tensor under several names, of which a file holds any one.
    """
    names: dict[int, list[str]] = {}
    for name in model.state_dict(keep_vars=True):
        owner, _, attr = name.rpartition(".")
        names.setdefault(id(getattr(model.get_submodule(owner), attr)), []).append(name)
    return {group[0]: group for group in names.values()}


def recompute_buffers(model: PreTrainedModel) -> None:
    """Fill the buffers no checkpoint holds (rotary frequencies) as the model's own init does."""
    stored = set(model.state_dict(keep_vars=True))
    owners = {name.rpartition(".")[0] for name, _ in model.named_buffers() if name not in stored}
    with torch.no_grad():
        for owner in sorted(owners):
            model._init_weights(model.get_submodule(owner))


def load_local_shards(model: nn.Module, files: dict[str, Path]) -> None:
    """Copy this rank's rows of every stored tensor from ``files`` into ``model``."""
    with torch.no_grad():
        for first, names in file_tensors(model).items():
            name = next((n for n in names if n in files), None)
            if name is None:
                raise KeyError(f"{first}: not in the target's safetensors files")
            owner, _, attr = first.rpartition(".")
            local, dim, start = local_rows(getattr(model.get_submodule(owner), attr))
            length = 0 if dim is None else local.shape[dim]
            local.copy_(read_rows(files[name], name, dim, start, length))


def load_target_shards(
    path_or_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Callable[[nn.Module], None],
) -> PreTrainedModel:
    """The target built on the meta device, sharded by ``shard``, then given this rank's rows.

    Host memory per rank is its shards plus one tensor's rows in flight, not the whole
    target. Weights that are not safetensors named as the model's parameters load whole and
    are sharded after, as :func:`load_target` would load them.
    """
    resolved = resolve_target_path(path_or_dir)
    directory = model_directory(resolved)
    files = weight_files(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = file_tensors(model).values()
    if files is None or not all(set(names) & files.keys() for names in tensors):
        why = "weights not all in safetensors files: each rank loads them whole, then shards"
        logger.warning(f"{directory}: {why}")
        model = load_target(path_or_dir, device="cpu", dtype=dtype)
        shard(model)
        return model
    shard(model)
    model.to_empty(device=device)
    recompute_buffers(model)
    load_local_shards(model, files)
    model.requires_grad_(False)
    model.eval()
    return model


def target_digest(directory: Path) -> str:
    """Digest of the target's files; for a reference, of the local model it points to too."""
    parts = {"directory": path_digest(directory)}
    resolved = Path(resolve_target_path(directory))
    if resolved != directory and resolved.exists():
        parts["referenced"] = path_digest(resolved)
    return digest(parts)
