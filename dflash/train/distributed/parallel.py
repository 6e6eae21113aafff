"""How the frozen target and the drafter are spread over ranks: DDP replicas or FSDP2 shards.

``train.parallelism: ddp`` keeps a whole target and drafter on every rank. ``fsdp`` shards
both per decoder layer with ``fully_shard``: a layer's weights are all-gathered just before
it runs and freed after, so a rank holds ``1/world_size`` of the weights, gradients and
optimizer state plus one gathered layer at a time. The target's embedding and LM head, which
the drafter borrows, are sharded units of the target too; the step gathers them once per
micro-batch around the drafter's forward and backward (:func:`borrowed_unsharded`) instead
of any rank keeping a whole copy. Either way each rank trains exactly its plan rows, and
gradients are averaged over ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dflash.features.target_forward import decoder_layers
from dflash.model.load import load_target_shards, target_device_dtype
from dflash.train.distributed.process_group import Dist


class DrafterDDP(DistributedDataParallel):
    """DDP that also exposes what the objective reads from the drafter besides its forward.

    ``head`` is the frozen, borrowed LM head, so using it outside DDP's forward leaves
    gradient synchronisation untouched.
    """

    @property
    def config(self):
        return self.module.config

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.module.head()


def sharded(ctx: Dist, parallelism: str) -> bool:
    """Whether this run shards: FSDP asked for, and more than one rank to shard over."""
    return parallelism == "fsdp" and ctx.enabled


def mesh(ctx: Dist) -> DeviceMesh:
    if ctx.group is not None:
        return DeviceMesh.from_group(ctx.group, ctx.device.type)
    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def shard_target(target: nn.Module, device_mesh: DeviceMesh) -> None:
    """Shard the frozen target per decoder layer, and its embedding and LM head, in place.

    A tied embedding and head are one parameter, so they form one unit. The decoder stack
    (``base_model``, which the features call) is the root; its own leftovers are the final
    norm and rotary buffers.
    """
    for layer in decoder_layers(target):
        fully_shard(layer, mesh=device_mesh)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if head.weight is embed.weight:
        fully_shard([embed, head], mesh=device_mesh)
    else:
        fully_shard(embed, mesh=device_mesh)
        fully_shard(head, mesh=device_mesh)
    fully_shard(target.base_model, mesh=device_mesh)


def load_sharded_target(path, ctx: Dist) -> nn.Module:
    """The frozen target sharded over ``ctx``'s ranks, each reading only its own shards.

    Built on the meta device, so neither a device nor a rank's host memory holds it whole.
    """
    device_mesh = mesh(ctx)
    return load_target_shards(
        path, ctx.device, target_device_dtype()[1], lambda target: shard_target(target, device_mesh)
    )


DRAFTER_PRECISION = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
"""FSDP keeps DDP's numbers: fp32 parameters gathered as they are, the step's autocast picks
bf16 for the matmuls on CUDA, and gradients are reduced in fp32. Gathering in bf16 instead
would also put the residual stream and the norms' weights in bf16, which DDP never does."""


def shard_drafter(drafter: nn.Module, device_mesh: DeviceMesh) -> None:
    """Shard the drafter per layer, in place, in the precision DDP trains it in."""
    for layer in drafter.layers:
        fully_shard(layer, mesh=device_mesh, mp_policy=DRAFTER_PRECISION)
    fully_shard(drafter, mesh=device_mesh, mp_policy=DRAFTER_PRECISION)


def wrap_drafter(drafter: nn.Module, ctx: Dist, parallelism: str) -> nn.Module:
    """The module the step calls: the (now sharded) drafter itself, a DDP replica, or as is."""
    if sharded(ctx, parallelism):
        shard_drafter(drafter, mesh(ctx))
        return drafter
    if not ctx.enabled:
        return drafter
    devices = [ctx.device] if ctx.device.type == "cuda" else None
    return DrafterDDP(drafter, device_ids=devices, process_group=ctx.group)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """Accumulate this micro-batch's gradients locally, without the collective."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def borrowed_unsharded(drafter: nn.Module) -> Iterator[None]:
    """Hold the borrowed embedding and head gathered for the drafter's forward and backward.

    Nothing to do when they are not sharded. The target's own forward regathers and frees
    them, so this opens after the target features and closes after the backward.
    """
    borrowed = getattr(drafter, "module", drafter).borrowed
    units = [m for m in (borrowed.embed_tokens, borrowed.lm_head) if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the gradients to ``max_norm`` in total and return their norm before clipping.

    The same arithmetic as ``torch.nn.utils.clip_grad_norm_``; with sharded gradients the
    total norm is first summed over the shards of every rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()
