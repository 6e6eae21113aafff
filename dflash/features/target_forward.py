"""The target's forward that yields features: the hidden states the drafter is conditioned on.

DFlash reads the outputs of ``n`` target decoder layers spread from the second layer to the
third-to-last and concatenates them, so the drafter sees both shallow and deep views of the
context. Rows may be packed with several documents; the target must then attend only inside a
document, with positions restarting at each document, so a packed row yields exactly the
features its documents would yield one by one. A target that mixes tokens other than by
attention takes its packed rows one document per row instead (:mod:`dflash.model.mixing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dflash.model.document_layout import DocumentLayout, packing
from dflash.model.mixing import by_document_rows, refuse, unconfined
from dflash.model.shipped import concat_layers
from dflash.model.target_attention import ExactPathNeeded, target_attention

if TYPE_CHECKING:
    from dflash.train.batches import MicroBatch


def feature_dtype(target: nn.Module) -> torch.dtype:
    """The dtype features travel and are stored in: the target's own (its embedding's)."""
    return target.get_input_embeddings().weight.dtype


def sliding_windows(target: nn.Module) -> tuple[int, ...]:
    """The sliding windows of the target's attention layers (none for full attention)."""
    attention = [getattr(layer, "self_attn", None) for layer in decoder_layers(target)]
    windows = {getattr(module, "sliding_window", None) for module in attention}
    return tuple(sorted(w for w in windows if isinstance(w, int)))


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (Qwen3, Llama and their kin)."""
    layers = getattr(target.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(target).__name__}: no decoder layers at base_model.layers")
    return layers


@contextlib.contextmanager
def _first_layers(target: nn.Module, n: int) -> Iterator[None]:
    """Run the decoder stack over its first ``n`` layers only (then its final norm, cheap).

    Cutting the list rather than raising out of a hook lets every module's forward finish,
    which a sharded (FSDP2) target needs to free the layers it gathered.
    """
    base, layers = target.base_model, decoder_layers(target)
    base.layers = layers[:n]
    try:
        yield
    finally:
        base.layers = layers


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    document_ids: Tensor,
    layer_ids: list[int],
    layout: DocumentLayout | bool | None = None,
    last: bool = False,
) -> Tensor:
    """Features ``[R, T, n*H]`` of a micro-batch of (possibly packed) rows; zero on padding.
    With ``last``, ``[R, T, (n+1)*H]``: the target's last hidden state (after its final norm,
    what its LM head reads) follows, for an objective that distills the target's distribution.

    Only the fused layers' outputs are kept (forward hooks), the target stops after the deepest
    of them and its LM head never runs: at a 150K vocabulary and 8K tokens, all hidden states
    plus one row of logits would outweigh the drafter's whole step. ``layout`` is
    :func:`packing` of ``document_ids``, computed ahead; None computes it here.
    """
    if not (input_ids.shape == position_ids.shape == document_ids.shape) or input_ids.ndim != 2:
        raise ValueError(
            "input_ids, position_ids and document_ids must all be [R, T]; got "
            f"{tuple(input_ids.shape)}, {tuple(position_ids.shape)}, {tuple(document_ids.shape)}"
        )
    if layout is None:
        layout = packing(document_ids)
    packed, sharded = layout is not False, _sharded(target)
    depth = len(decoder_layers(target)) if last else max(layer_ids) + 1
    # A sharded target's forwards are collectives: its ranks all go one way, one row or packed.
    if (packed or sharded) and unconfined(target, decoder_layers(target), depth):
        return _by_rows(target, input_ids, document_ids, layer_ids, sharded, last)
    if not packed:
        # Equal on the real tokens; on padding, a position restarting at 0 would make Hugging
        # Face read the rows as packed and build a dense [R, 1, T, T] mask.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return _features(
            target, input_ids, positions.expand_as(input_ids), document_ids, layer_ids, last=last
        )
    try:
        with target_attention(target):
            return _features(target, input_ids, position_ids, document_ids, layer_ids, layout, last)
    except ExactPathNeeded:
        if sharded:  # its other ranks went on with the forward: no second one here
            raise
        refuse(target)
        return _by_rows(target, input_ids, document_ids, layer_ids, sharded, last)


def micro_batch_features(
    target: nn.Module, layer_ids: list[int], mb: MicroBatch, last: bool = False
) -> Tensor:
    """The target features of one micro-batch, run the way its loader laid its rows out (with
    the target's last hidden state after them where ``last``)."""
    return target_features(
        target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids, mb.layout, last=last
    )


def _features(
    target: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    document_ids: Tensor,
    layer_ids: list[int],
    layout: DocumentLayout | None = None,
    last: bool = False,
) -> Tensor:
    """One forward of the target's first layers, keeping the fused layers' outputs (and, with
    ``last``, of all its layers, keeping its last hidden state too)."""
    layers, outputs = decoder_layers(target), {}

    def keep_output(index: int):
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    extra = {} if layout is None else {"document_layout": layout}
    handles = [layers[i].register_forward_hook(keep_output(i)) for i in sorted(set(layer_ids))]
    try:
        with _first_layers(target, len(layers) if last else max(layer_ids) + 1):
            out = target.base_model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
            )
    finally:
        for handle in handles:
            handle.remove()
    features = concat_layers(outputs, layer_ids, *([out.last_hidden_state] if last else []))
    return features * (document_ids >= 0)[..., None].to(features.dtype)


def _by_rows(
    target: nn.Module,
    input_ids: Tensor,
    document_ids: Tensor,
    layer_ids: list[int],
    sharded: bool,
    last: bool = False,
) -> Tensor:
    """Features computed one document per row (exact for any target); a sharded target's
    ranks first agree on how many forwards they run."""

    def run(ids: Tensor, positions: Tensor, documents: Tensor) -> Tensor:
        return _features(target, ids, positions, documents, layer_ids, last=last)

    def most_over_shards(n: int, device: torch.device) -> int:
        return _most_over_ranks(n, device, _shard_group(target))

    return by_document_rows(run, input_ids, document_ids, most_over_shards if sharded else None)


def _sharded(target: nn.Module) -> bool:
    """Whether ``target``'s forward is a collective (FSDP2): every rank must run the same ones."""
    return any(isinstance(p, DTensor) for p in target.parameters())


def _shard_group(target: nn.Module) -> dist.ProcessGroup:
    """The ranks a sharded target is sharded over: all of the job's, or only the target ranks'
    of a decoupled run (:mod:`dflash.features.target_ranks`)."""
    return next(p for p in target.parameters() if isinstance(p, DTensor)).device_mesh.get_group()


def _most_over_ranks(n: int, device: torch.device, group: dist.ProcessGroup) -> int:
    count = torch.tensor([n], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)
