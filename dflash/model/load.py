"""The one way every stage after ``target`` loads the frozen target (a leaf: no pretraining).

``models/target/`` holds either the tiny default in full or a reference file that points at
a real model directory; both load here, frozen, in eval mode and in the device's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from dflash import paths
from dflash.fingerprint import digest, path_digest


def target_device_dtype() -> tuple[torch.device, torch.dtype]:
    """bf16 on CUDA, where the target's matmuls are fast in it; fp32 on CPU, where it is not."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def resolve_target_path(path_or_dir: str | Path) -> str:
    """The model directory (or hub id) behind ``path_or_dir``, following a reference file."""
    reference = Path(path_or_dir) / paths.TARGET_REFERENCE
    if reference.is_file():
        return json.loads(reference.read_text())["path"]
    return str(path_or_dir)


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


def target_digest(directory: Path) -> str:
    """Digest of the target's files; for a reference, of the local model it points to too."""
    parts = {"directory": path_digest(directory)}
    resolved = Path(resolve_target_path(directory))
    if resolved != directory and resolved.exists():
        parts["referenced"] = path_digest(resolved)
    return digest(parts)
