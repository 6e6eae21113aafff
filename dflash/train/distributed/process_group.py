"""Process-group setup for ``torchrun``: gloo on CPU, NCCL on CUDA, one process = one rank.

Outside ``torchrun`` (no ``RANK`` in the environment) training runs as a single rank without
a process group, so tests and notebooks need no launcher.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from dflash.pipeline.lock import launched_by_torchrun
from dflash.train.distributed.allocator import configure_allocator

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    """The ranks this one trains with; None = all of them (``dflash.train.topology``)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def init_distributed(timeout_s: float = 600.0) -> Dist:
    """Join the process group ``torchrun`` describes in the environment (or none)."""
    configure_allocator(os.environ)
    if not launched_by_torchrun():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Dist(rank=0, world_size=1, local_rank=0, device=device)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # A device_id binds NCCL's communicator to this rank's GPU at once (no guessing later).
        bound = device if device.type == "cuda" else None
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=_round_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=bound,
        )
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def _round_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store, under a prefix of its own for each restart: the agent keeps one store
    across restarts, so without it a restarted rank can read the address a rank of the failed
    round published and fail to connect to it."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown(ctx: Dist) -> None:
    if ctx.enabled:
        dist.destroy_process_group()


def all_reduce_sum(ctx: Dist, values: torch.Tensor) -> torch.Tensor:
    """Sum a float64 tensor over ranks (float64: the global loss-weight sum must not drift), on
    ``ctx.device``: the caller reads it back when it needs the values, not at every sum."""
    values = values.to(ctx.device)
    if ctx.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=ctx.group)
    return values


def from_rank_zero(ctx: Dist, compute: Callable[[], T]) -> T:
    """``compute()`` on rank 0 alone, its result handed to every rank.

    For digests of large inputs (a 140 GB target directory, the token store): one read of the
    files instead of one per rank, and one answer, so no rank can disagree with another.
    """
    value = compute() if ctx.is_main else None
    if ctx.enabled:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=ctx.group)  # global rank 0: drafter rank 0
        value = box[0]
    return value


def barrier(ctx: Dist) -> None:
    if ctx.enabled:
        dist.barrier(group=ctx.group)
