"""Reading distributed checkpoints without running pickled code.

``torch.distributed.checkpoint`` pickles two things: its ``.metadata`` index, and every
non-tensor value of a state dict (counters, param groups, RNG words), which its default
planner loads with ``torch.load(weights_only=False)``. A checkpoint here holds tensors and
plain types only, so the values load with ``weights_only=True`` and the index with an
unpickler that admits only the checkpoint metadata classes and torch's dtypes and sizes: a
file that names anything else is refused, never executed.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
"""Modules whose classes may appear in a checkpoint's index (its dataclasses and enums)."""
ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in METADATA_MODULES or (module, name) in ALLOWED:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, torch.dtype):
            return value
        raise pickle.UnpicklingError(f"checkpoint index names {module}.{name}: refused")


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` whose index is read by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _IndexUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path}: not a checkpoint index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        super().load_bytes(read_item, io.BytesIO(_plain(value)))


def _plain(value: io.BytesIO) -> bytes:
    """The value's bytes, after checking they unpickle to tensors and plain types only."""
    data = value.read()
    torch.load(io.BytesIO(data), weights_only=True)
    return data
