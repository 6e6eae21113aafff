"""Which way a target's packed rows go: document attention, or one document per row.

Document attention (:mod:`dflash.model.target_attention`) confines softmax attention to each
document of a packed row; it confines nothing else. A layer that mixes tokens any other way
(linear attention and its short convolution, a state-space scan, a token shift) would carry
one document's state into the next. So each module of the decoder layers that run is judged
by what it is, not by the model's name:

- **attention** the kernel replaces: its forward dispatches through Hugging Face's attention
  functions, in a layer whose ``layer_types`` entry is full or sliding attention, holding no
  parameters of its own but sinks;
- **pointwise**: torch's linear, embedding, norm, dropout and activation modules, and Hugging
  Face classes by role (norms, rotary embeddings, MoE experts and routers hold weights; decoder
  layers, MLPs and MoE blocks only wire their children);
- **anything else** is a mixer of unknown kind, and the whole target then runs its documents
  as separate rows (:func:`by_document_rows`): exact by construction, at the price of padding
  each document to its length class.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dflash.model.document_layout import DocumentLayout

CONFINED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""``config.layer_types`` entries whose layers document attention confines."""

POINTWISE = (nn.Linear, nn.Embedding, nn.Dropout, nn.Identity, nn.LayerNorm, nn.RMSNorm)

ACTIVATION_MODULES = frozenset({"torch.nn.modules.activation", "transformers.activations"})
"""Where activation classes live (``nn.MultiheadAttention`` lives there too, and is not one)."""

WEIGHTED_ROLES = ("RMSNorm", "LayerNorm", "RotaryEmbedding", "Experts", "Router")
"""Class-name endings of Hugging Face modules that act on each token alone, with weights."""

WIRING_ROLES = ("DecoderLayer", "MLP", "SparseMoeBlock", "MoE")
"""Class-name endings of Hugging Face modules that only wire their children together."""

ATTENTION_PARAMETERS = frozenset({"sinks"})
"""Parameters an attention module may hold itself: sinks go to the kernel (``s_aux``)."""

_REFUSED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Targets whose attention asked document attention for something it does not apply."""


def dispatches_attention(module: nn.Module) -> bool:
    """Whether ``module``'s forward calls Hugging Face's attention functions (the ones
    ``target_attention`` swaps), read from its code, under any decorators."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _own_parameters(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters(recurse=False)}


def pointwise(module: nn.Module) -> bool:
    """Whether ``module`` acts on each token alone (by type, or by role for Hugging Face's)."""
    kind, name = type(module), type(module).__name__
    if isinstance(module, POINTWISE):
        return True
    if kind.__module__ in ACTIVATION_MODULES and not isinstance(module, nn.MultiheadAttention):
        return True
    if name.endswith(WEIGHTED_ROLES):
        return True
    return name.endswith(WIRING_ROLES) and not _own_parameters(module)


def confined_attention(module: nn.Module, layer_type: str | None) -> bool:
    """Whether ``module`` is attention that document attention confines to each document."""
    if layer_type is not None and layer_type not in CONFINED_LAYER_TYPES:
        return False
    return dispatches_attention(module) and _own_parameters(module) <= ATTENTION_PARAMETERS


def mixers(layer: nn.Module, layer_type: str | None) -> list[str]:
    """The modules of one decoder layer that document attention would not confine, as
    ``name (Class)``; empty when it confines the whole layer."""
    return [
        f"{name or '<layer>'} ({type(module).__name__})"
        for name, module in layer.named_modules()
        if not (pointwise(module) or confined_attention(module, layer_type))
    ]


def unconfined(target: nn.Module, layers: nn.ModuleList, depth: int) -> list[str]:
    """What, in the first ``depth`` decoder ``layers`` of ``target``, mixes tokens beyond
    document attention's reach, as ``layer i: name (Class)``: empty means packed rows may
    take it. A target whose attention once refused (:func:`refuse`) lists that."""
    if target in _REFUSED:
        return ["attention: asked for what document attention does not apply"]
    types = getattr(target.config, "layer_types", None) or [None] * len(layers)
    return [
        f"layer {i}: {found}"
        for i, layer in enumerate(layers[:depth])
        for found in mixers(layer, types[i])
    ]


def refuse(target: nn.Module) -> None:
    """Send ``target``'s packed rows down the exact path from now on."""
    _REFUSED.add(target)


def by_document_rows(
    run: Callable[[Tensor, Tensor, Tensor], Tensor],
    input_ids: Tensor,
    document_ids: Tensor,
    agree: Callable[[int, torch.device], int] | None = None,
) -> Tensor:
    """``run``'s features ``[R, T, F]`` of packed rows, computed on one document per row.

    ``run(input_ids, position_ids, document_ids)`` sees rows of one document each, a length
    class at a time (:meth:`DocumentLayout.documents`: padded to a multiple of
    ``LENGTH_STEP``), so no layer can see across documents; zero on padding. ``agree`` turns
    this call's number of ``run`` calls into the one every rank makes (the most of them); the
    extra calls run on one token and are dropped.
    """
    R, T = input_ids.shape
    classes = DocumentLayout.of(document_ids).documents()
    local = max(len(classes), 1)  # nothing but padding: one run of the rows as they are
    calls = agree(local, input_ids.device) if agree is not None else local
    one = input_ids[:1, :1]
    for _ in range(calls - local):
        run(one, torch.zeros_like(one), torch.zeros_like(one))
    if not classes:
        return run(input_ids, torch.zeros_like(input_ids), document_ids)
    out = None
    for docs in classes:
        ids = input_ids.flatten()[docs.source]
        positions = torch.arange(docs.width, device=ids.device).expand_as(ids)
        features = run(ids, positions, torch.where(docs.target < R * T, 0, -1))
        if out is None:
            out = features.new_zeros(R * T + 1, features.shape[-1])
        out.index_copy_(0, docs.target.flatten(), features.flatten(0, 1))
    return out[: R * T].view(R, T, -1)
