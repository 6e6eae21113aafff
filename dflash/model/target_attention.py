"""The target's attention over packed rows: causal inside each document, within its window.

A packed row handed to SDPA with a block-diagonal ``T x T`` mask scores every pair of the row
and masks most of them away; one SDPA call per document pays a kernel launch per document
and layer instead, which grows with the number of documents a row holds. Two kernels here,
each a few SDPA calls per layer however many documents the rows hold:

- **Documents in length classes** (full-attention layers, and sliding-window layers whose
  window no document outgrows): each document is copied once into a class of documents padded
  to the same multiple of ``LENGTH_STEP`` tokens, and each class runs SDPA's causal kernel,
  which skips what a query may not see. The varlen idea, with a few padded widths; documents
  of one length lying back to back (one alone in its class, say) are read and written in
  place.
- **Query tiles** (sliding-window layers over documents longer than the window): the row is
  cut into tiles of ``QUERY_TILE`` queries; each gathers only the keys it may see, from its
  first query's document start or the window's left edge up to its last query, and tiles
  needing up to 64, 128, 256, ... keys run as one masked SDPA call per width class. A
  sliding-window layer pays for its window, not for its documents' lengths.

Attention sinks (gpt-oss: one extra logit per head, in every query's softmax, with no value)
ride along as one more key: its score is the sink, its value zero (``_with_sink``), so the
same kernels merge it by log-sum-exp.

The function is registered with Hugging Face's attention interfaces under ``NAME`` and is
switched on only for the feature pass over packed rows (``target_attention``); the
micro-batch's :class:`DocumentLayout` (:mod:`dflash.model.document_layout`, where
``LENGTH_STEP`` and ``QUERY_TILE`` live) reaches it as a keyword argument of the model's forward.
Which targets may take it at all is :mod:`dflash.model.mixing`'s call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from dflash.model.document_layout import DocumentLayout, Documents

NAME = "dflash_documents"

HARMLESS = frozenset(
    {"dropout", "position_ids", "use_cache", "output_attentions", "cache_position"}
)
"""Attention keyword arguments that change nothing here: the target is frozen, in eval mode,
and its positions are already in its queries and keys. Any other one this kernel does not
apply (logit soft-capping, sparse indices, ...) is refused rather than silently misread."""

HEAD_ALIGN = 8
"""Head widths with a sink column are padded to a multiple of this: fused kernels want it."""


class ExactPathNeeded(NotImplementedError):
    """The target's attention asks for something document attention does not apply."""


def _positions(x: Tensor) -> Tensor:
    """``x [R, heads, T, d]`` as ``[R*T, heads, d]``: a view of Hugging Face's own layout."""
    R, heads, T, d = x.shape
    return x.transpose(1, 2).reshape(R * T, heads, d)


def _gather(flat: Tensor, index: Tensor) -> Tensor:
    """``flat [R*T, heads, d]`` at the positions ``index [N, W]``: ``[N, heads, W, d]``.

    ``index_select`` copies whole rows of ``heads x d``; advanced indexing goes element by
    element and took about a quarter of the feature pass.
    """
    picked = flat.index_select(0, index.flatten())
    return picked.view(*index.shape, *flat.shape[1:]).transpose(1, 2)


def _read(flat: Tensor, docs: Documents) -> Tensor:
    """A class's slots of ``flat [R*T, heads, d]``: ``[count, heads, width, d]``."""
    if docs.span is None:
        return _gather(flat, docs.source)
    return flat[docs.span].view(docs.count, docs.width, *flat.shape[1:]).transpose(1, 2)


def _with_sink(
    query: Tensor, key: Tensor, value: Tensor, sinks: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``query [N, H, Q, D]``, ``key/value [N, KV, K, D]`` with one key put first whose score
    is ``sinks [H]`` for every query and whose value is zero: softmax over the keys and the
    sink, as the sink's own definition says. Heads widen by a column: each query holds its
    head's ``sink / scale`` there, the sink key a 1, every other key a 0 (values widen with
    zeros, so one kernel takes all three: outputs past the value's width are dropped)."""
    D = query.shape[-1]
    width = -(-(D + 1) // HEAD_ALIGN) * HEAD_ALIGN
    q = F.pad(query, (0, width - D))
    q[..., D] = (sinks.float() / scale).to(q.dtype)[:, None]
    k = F.pad(key, (0, width - D, 1, 0))
    v = F.pad(value, (0, max(width - value.shape[-1], 0), 1, 0))
    k[:, :, 0, D] = 1
    return q, k, v


def _causal(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, scale: float) -> Tensor:
    """Causal SDPA of one length class, with the sink key where there are sinks: a leading
    dummy query lines the causal rule up with it (query ``i`` sees the sink and keys ``<= i``)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    D = v.shape[-1]
    q, k, v = _with_sink(F.pad(q, (0, 0, 1, 0)), k, v, sinks, scale)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out[:, :, 1:, :D]


def _by_documents(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    classes: list[Documents],
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention inside each document, one SDPA call per length class: ``[R, T, H, D]``
    (zero on padding)."""
    R, H, T = query.shape[:3]
    D = value.shape[-1]  # MLA targets' values are narrower than their queries and keys
    flat = [_positions(x) for x in (query, key, value)]
    out = query.new_zeros(R * T + 1, H, D)  # the last row takes the padding slots' outputs
    for docs in classes:
        q, k, v = (_read(x, docs) for x in flat)
        part = _causal(q, k, v, sinks, scale)
        slots = part.transpose(1, 2).reshape(-1, H, D)
        if docs.span is None:
            out.index_copy_(0, docs.target.flatten(), slots)
        else:
            out[docs.span] = slots
    return out[: R * T].view(R, T, H, D)


def _by_tiles(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: DocumentLayout,
    window: int | None,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """Document-causal attention within ``window``, one SDPA call per width class of query
    tiles: ``[R, T, H, D]``."""
    R, H, T, D = query.shape
    Q = layout.tile
    n = -(-T // Q)
    q = F.pad(query, (0, 0, 0, n * Q - T)).view(R, H, n, Q, D).transpose(1, 2)
    q = q.reshape(R * n, H, Q, D)
    Dv = value.shape[-1]  # MLA targets' values are narrower than their queries and keys
    out = q.new_empty(R * n, H, Q, Dv)
    keys, values = _positions(key), _positions(value)
    for tiles, mask in zip(layout.tiles(window), layout.masks(window, q.dtype), strict=True):
        picked = q.index_select(0, tiles.index)
        k, v = _gather(keys, tiles.keys), _gather(values, tiles.keys)
        if sinks is not None:
            picked, k, v = _with_sink(picked, k, v, sinks, scale)
            mask = F.pad(mask, (1, 0))  # every query sees the sink
        part = F.scaled_dot_product_attention(
            picked, k, v, attn_mask=mask, scale=scale, enable_gqa=H != key.shape[1]
        )
        out.index_copy_(0, tiles.index, part[..., :Dv])
    return out.view(R, n, H, Q, Dv).transpose(2, 3).reshape(R, n * Q, H, Dv)[:, :T]


def _layer_type(module: nn.Module) -> str | None:
    """The attention layer's type in its config's ``layer_types``, where it says."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    return types[index] if types is not None and index is not None else None


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    document_layout: DocumentLayout | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Document-causal (and windowed) attention of ``query/key/value [R, heads, T, D]``, with
    the sink logits ``s_aux [heads]`` where the target has them.

    By length classes where the window changes nothing, else by query tiles. Returns
    ``[R, T, heads, D]`` as Hugging Face attention functions do. Dropout and the (absent) mask
    are ignored: the target is frozen, in eval mode.
    """
    if document_layout is None:
        raise ExactPathNeeded("packed rows: the target's attention does not pass the layout on")
    unapplied = sorted(k for k, v in kwargs.items() if k not in HARMLESS and v is not None)
    if is_causal is False:
        unapplied.append("is_causal=False")
    if sliding_window is None and _layer_type(module) == "sliding_attention":
        unapplied.append("a sliding window only its mask would apply")
    if unapplied:
        raise ExactPathNeeded(f"packed rows: the target's attention uses {', '.join(unapplied)}")
    layout, scale = document_layout, scaling if scaling is not None else query.shape[-1] ** -0.5
    if layout.fits(sliding_window):
        return _by_documents(query, key, value, layout.documents(), scale, s_aux), None
    return _by_tiles(query, key, value, layout, sliding_window, scale, s_aux), None


def no_mask(*args, **kwargs) -> None:
    """The mask builder for ``NAME``: the layout says everything, so no mask is ever built."""
    return None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, no_mask)


@contextlib.contextmanager
def target_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s attention through ``attention`` for the duration of the block.

    The implementation is a field of the config every attention module shares; it is put
    back afterwards, so generation and scoring with the same model keep their own kernel.
    """
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
