"""Host reads of device data, counted over a stretch of code on any device.

A host read (``.item()``, ``bool(t)``, ``.tolist()``, a copy to the CPU) makes the CPU wait
until the GPU has run everything queued before it, and the GPU then idles until the CPU
launches more: a few per micro-batch cost little, one per layer or per document costs the
overlap. Ops whose output size depends on the data (``nonzero``, boolean indexing,
``unique``, ``bincount``...) read the device too, to size their output. On CPU nothing waits,
so :class:`HostReads` counts the ops that *would* wait on a GPU, and a test on CPU sees what
a GPU run would pay.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import dflash

aten = torch.ops.aten

DATA_SIZED = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
"""Ops that read device data on the host: a scalar out, or an output sized by the data
(``bincount`` on CUDA reads the maximum even with ``minlength``)."""

SIZED_WITHOUT = {
    aten.repeat_interleave.Tensor: "output_size",
    aten.repeat_interleave.self_Tensor: "output_size",
}
"""Ops that read nothing when told their output size by this keyword."""

INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
"""Indexing reads the device when an index is a boolean mask (turned into ``nonzero``)."""

COPIES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default}

HOST_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}
"""Reads that bypass the dispatcher on CPU tensors (on a GPU they copy, counted as such)."""

_HERE = str(Path(__file__).resolve())
_PACKAGE = str(Path(dflash.__file__).resolve().parent)


@dataclass(frozen=True)
class HostRead:
    op: str
    site: str
    """``path:line in function`` of the innermost frame of the package (else of any caller)."""


def _site() -> str:
    """The innermost caller frame in ``dflash`` (not this module), else the innermost outside
    torch: where the read was asked for."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _HERE and path.startswith(_PACKAGE):
            where = Path(path).relative_to(Path(_PACKAGE).parent)
            return f"{where}:{frame.f_lineno} in {frame.f_code.co_name}"
        if fallback is None and "torch" not in Path(path).parts and path != _HERE:
            fallback = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _reads(func, args, kwargs, out) -> bool:
    if func in DATA_SIZED:
        keyword = SIZED_WITHOUT.get(func)
        return keyword is None or kwargs.get(keyword) is None
    if func in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
            for t in _leaves(indices)
        )
    if func in COPIES:
        sources = [t for t in _leaves(list(args)) if isinstance(t, torch.Tensor)]
        return out.device.type == "cpu" and any(t.device.type != "cpu" for t in sources)
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, reads: list[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = out if isinstance(out, torch.Tensor) else args[0] if args else None
        if isinstance(target, torch.Tensor) and _reads(func, args, kwargs, target):
            self.reads.append(HostRead(str(func), _site()))
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, reads: list[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_METHODS and args[0].device.type == "cpu":
            self.reads.append(HostRead(func.__name__, _site()))
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager that records every host read of tensor data inside it.

    ``len(reads)`` is the count; ``reads.by_site()`` says where they were asked for.
    """

    def __init__(self) -> None:
        self.reads: list[HostRead] = []
        self._modes = (_Functions(self.reads), _Dispatch(self.reads))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.reads)

    def by_site(self) -> collections.Counter[str]:
        return collections.Counter(f"{r.site} ({r.op})" for r in self.reads)
