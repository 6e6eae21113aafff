"""What a target directory holds, read without loading the model.

``models/target/`` holds the tiny default in full, or a reference file to a real model that
is not copied. The launching process reads these before torch's model code is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from dflash.model.hf_files import WEIGHTS, WEIGHTS_INDEX

TARGET_REFERENCE = "dflash_target.json"
"""In a target directory: the reference to a model that is not copied (``target.path``)."""


def resolve_target_path(path_or_dir: str | Path) -> str:
    """The model directory (or hub id) behind ``path_or_dir``, following a reference file."""
    reference = Path(path_or_dir) / TARGET_REFERENCE
    if reference.is_file():
        return json.loads(reference.read_text())["path"]
    return str(path_or_dir)


def weight_files(directory: Path) -> dict[str, Path] | None:
    """Which safetensors file holds each tensor, or None for weights in another format."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS
    if not single.is_file():
        return None
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def weights_bytes(directory: Path) -> int:
    """A model's safetensors weights on disk, in bytes (0 for weights in another format)."""
    files = weight_files(directory) if directory.is_dir() else None
    return sum(path.stat().st_size for path in set((files or {}).values()))
