"""The target's attention over packed rows: causal inside each document, within its window.

A packed row handed to SDPA with a block-diagonal ``T x T`` mask scores every pair of the row
and masks most of them away; one SDPA call per document pays a kernel launch per document
and layer instead, which grows with the number of documents a row holds. Here the row is cut
into tiles of ``QUERY_TILE`` queries, and each tile gathers only the keys it may see: from the
start of its first query's document (or the window's left edge, whichever is later) up to its
last query. The tiles of a micro-batch run as one masked SDPA call per layer and width class
(tiles needing up to 64, 128, 256, ... keys; the varlen idea, with tiles instead of
documents), so the cost follows the documents' lengths, not their number, and a
sliding-window layer pays only for its window.

The function is registered with Hugging Face's attention interfaces under ``NAME`` and is
switched on only for the feature pass over packed rows (``document_attention``); the
micro-batch's :class:`DocumentLayout` reaches it as a keyword argument of the model's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from dflash.model.attention import document_starts

NAME = "dflash_documents"

QUERY_TILE = 64
"""Queries per tile: a tile's keys reach back to its first query's document start, so smaller
tiles waste fewer keys at document starts but gather more copies of the keys."""

UNSUPPORTED = ("softcap", "s_aux")
"""Attention keyword arguments some targets pass (Gemma-2 logit soft-capping, gpt-oss sinks)
that this kernel does not apply: such a target is refused rather than silently misread."""


@dataclass(frozen=True)
class Tiles:
    """One width class of a micro-batch's query tiles: the tiles and the keys each may see.

    ``index [N]`` are the tiles' places among the ``R*n`` tiles (row-major), ``keys [N, W]``
    index the flattened ``R*T`` positions (clamped; hidden ones are masked) and
    ``mask [N, 1, Q, W]`` says which of them each tile's ``Q`` queries see.
    """

    index: Tensor
    keys: Tensor
    mask: Tensor


def tile_keys(starts: Tensor, window: int | None, tile: int) -> list[Tiles]:
    """Tiles of ``tile`` queries over rows whose document starts are ``starts [R, T]``, in
    classes by how many keys they need: ``tile`` times a power of two (at most the widest).

    One width for every tile would make each tile of a micro-batch gather as many keys as the
    longest document needs; in classes, a tile gathers at most twice what it needs, for at most
    ``log2(T / tile) + 1`` kernel calls per layer, however many documents the rows hold.
    A query ``i`` sees key ``j`` iff ``j`` is in its document, ``j <= i`` and, with a window,
    ``j > i - window`` (Hugging Face's rule: ``window`` keys counting itself). Queries past the
    row's end see their tile's first key, so no softmax is empty; their outputs are dropped.
    """
    R, T = starts.shape
    n = -(-T // tile)
    first = torch.arange(n, device=starts.device) * tile  # [n]
    low = starts[:, first]  # [R, n]
    if window is not None:
        low = torch.maximum(low, first - window + 1)
    span = ((first + tile).clamp(max=T) - low).flatten()  # [R*n] keys each tile needs
    width = torch.full_like(span, tile)
    while bool((width < span).any()):
        width = torch.where(width < span, 2 * width, width)
    width = width.clamp(max=int(span.max()))
    return [
        _tiles(starts, torch.nonzero(width == w).flatten(), low.flatten(), w, window, tile)
        for w in width.unique().tolist()
    ]


def _tiles(
    starts: Tensor, index: Tensor, low: Tensor, width: int, window: int | None, tile: int
) -> Tiles:
    """The keys and mask of the tiles at ``index`` (of ``R*n``), ``width`` keys each."""
    T, n = starts.shape[1], -(-starts.shape[1] // tile)
    row, first = index // n, (index % n) * tile
    arange = torch.arange(max(width, tile), device=starts.device)
    keys = low[index, None] + arange[:width]  # [N, W]
    queries = first[:, None] + arange[:tile]  # [N, Q]
    q, k = queries[:, :, None], keys[:, None, :]
    safe_q, safe_k = queries.clamp(max=T - 1), keys.clamp(max=T - 1)
    key_doc = starts[row[:, None], safe_k][:, None, :]
    query_doc = starts[row[:, None], safe_q][:, :, None]
    mask = (key_doc == query_doc) & (k <= q) & (k < T)
    if window is not None:
        mask &= k > q - window
    mask[..., 0] |= queries >= T
    return Tiles(index, row[:, None] * T + safe_k, mask[:, None])


@dataclass
class DocumentLayout:
    """Where each document of a micro-batch's rows starts, and its tiles per window size.

    Built once per micro-batch; the tiles of each window size (``None`` for full layers) are
    built on first use and shared by every layer of that kind.
    """

    starts: Tensor
    tile: int = QUERY_TILE
    _tiles: dict[int | None, list[Tiles]] = field(default_factory=dict)

    @classmethod
    def of(cls, document_ids: Tensor) -> DocumentLayout:
        """The layout of rows of ``document_ids [R, T]``; padding (-1) runs are documents too,
        whose outputs nobody reads."""
        return cls(document_starts(document_ids), min(QUERY_TILE, document_ids.shape[1]))

    def tiles(self, window: int | None) -> list[Tiles]:
        if window not in self._tiles:
            self._tiles[window] = tile_keys(self.starts, window, self.tile)
        return self._tiles[window]


def _gather(x: Tensor, keys: Tensor) -> Tensor:
    """Keys or values ``x [R, Hkv, T, d]`` at the tiles' key positions: ``[N, Hkv, W, d]``."""
    R, Hkv, T, d = x.shape
    flat = x.transpose(1, 2).reshape(R * T, Hkv, d)
    return flat[keys.flatten()].view(*keys.shape, Hkv, d).transpose(1, 2)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    document_layout: DocumentLayout,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Document-causal (and windowed) attention of ``query/key/value [R, heads, T, D]``.

    One SDPA call per width class of tiles. Returns ``[R, T, heads, D]`` as Hugging Face
    attention functions do. Dropout and the (absent) mask are ignored: the target is frozen, in
    eval mode.
    """
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"packed rows: the target's attention uses {name}")
    R, H, T, D = query.shape
    Q = document_layout.tile
    n = -(-T // Q)
    q = F.pad(query, (0, 0, 0, n * Q - T)).view(R, H, n, Q, D).transpose(1, 2)
    q = q.reshape(R * n, H, Q, D)
    out = torch.empty_like(q)
    for tiles in document_layout.tiles(sliding_window):
        out[tiles.index] = F.scaled_dot_product_attention(
            q[tiles.index],
            _gather(key, tiles.keys),
            _gather(value, tiles.keys),
            attn_mask=tiles.mask,
            scale=scaling,
            enable_gqa=H != key.shape[1],
        )
    return out.view(R, n, H, Q, D).transpose(2, 3).reshape(R, n * Q, H, D)[:, :T], None


def no_mask(*args, **kwargs) -> None:
    """The mask builder for ``NAME``: the layout says everything, so no mask is ever built."""
    return None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, no_mask)


@contextlib.contextmanager
def document_attention(model: nn.Module) -> Iterator[None]:
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
