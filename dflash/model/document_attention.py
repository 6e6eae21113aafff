"""The target's attention over packed rows: causal inside each document, within its window.

A packed row handed to SDPA with a block-diagonal ``T x T`` mask scores every pair of the row
and masks most of them away; one SDPA call per document pays a kernel launch per document
and layer instead, which grows with the number of documents a row holds. Here the row is cut
into tiles of ``QUERY_TILE`` queries, and each tile gathers only the keys it may see: from the
start of its first query's document (or the window's left edge, whichever is later) up to its
last query. All tiles of a micro-batch then run as one masked SDPA call per layer (the varlen
idea, with tiles instead of documents), so the cost follows the documents' lengths, not their
number, and a sliding-window layer pays only for its window.

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
    """The query tiles of a micro-batch and the keys each may see.

    ``keys [N, W]`` index the flattened ``R*T`` positions (clamped; hidden ones are masked) and
    ``mask [N, 1, Q, W]`` says which of them each tile's ``Q`` queries see.
    """

    keys: Tensor
    mask: Tensor


def tile_keys(starts: Tensor, window: int | None, tile: int) -> Tiles:
    """Tiles of ``tile`` queries over rows whose document starts are ``starts [R, T]``.

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
    high = (first + tile).clamp(max=T)
    width = int((high - low).max())
    keys = low[:, :, None] + torch.arange(width, device=starts.device)  # [R, n, W]
    queries = first[:, None] + torch.arange(tile, device=starts.device)  # [n, Q]
    q, k = queries[None, :, :, None], keys[:, :, None, :]
    safe_q, safe_k = q.clamp(max=T - 1), k.clamp(max=T - 1)
    key_doc = starts.gather(1, safe_k.reshape(R, -1)).view(R, n, 1, width)
    query_doc = starts[:, safe_q.flatten()].view(R, n, tile, 1)
    mask = (key_doc == query_doc) & (k <= q) & (k < T)
    if window is not None:
        mask &= k > q - window
    mask[..., 0] |= (q >= T)[..., 0]
    rows = torch.arange(R, device=starts.device)[:, None, None] * T
    return Tiles((rows + safe_k[:, :, 0]).view(R * n, width), mask.view(R * n, 1, tile, width))


@dataclass
class DocumentLayout:
    """Where each document of a micro-batch's rows starts, and its tiles per window size.

    Built once per micro-batch; the tiles of each window size (``None`` for full layers) are
    built on first use and shared by every layer of that kind.
    """

    starts: Tensor
    tile: int = QUERY_TILE
    _tiles: dict[int | None, Tiles] = field(default_factory=dict)

    @classmethod
    def of(cls, document_ids: Tensor) -> DocumentLayout:
        """The layout of rows of ``document_ids [R, T]``; padding (-1) runs are documents too,
        whose outputs nobody reads."""
        return cls(document_starts(document_ids), min(QUERY_TILE, document_ids.shape[1]))

    def tiles(self, window: int | None) -> Tiles:
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

    One SDPA call over all tiles. Returns ``[R, T, heads, D]`` as Hugging Face attention
    functions do. Dropout and the (absent) mask are ignored: the target is frozen, in eval mode.
    """
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"packed rows: the target's attention uses {name}")
    R, H, T, D = query.shape
    tiles, Q = document_layout.tiles(sliding_window), document_layout.tile
    n = tiles.keys.shape[0] // R
    q = F.pad(query, (0, 0, 0, n * Q - T)).view(R, H, n, Q, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.reshape(R * n, H, Q, D),
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
