"""Where a micro-batch's documents lie: their length classes and query tiles, read once.

The target's document attention (:mod:`dflash.model.target_attention`) runs over this layout,
and the DataLoader workers build it on CPU tensors ahead of the step (:func:`packing`), so the
feature pass reads nothing back from the device. It needs torch alone: a spawned loader worker
imports this, not the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash.model.drafter_attention import additive_mask, document_starts

QUERY_TILE = 64
"""Queries per tile: a tile's keys reach back to its first query's document start, so smaller
tiles waste fewer keys at document starts but gather more copies of the keys."""

LENGTH_STEP = 64
"""Documents are padded up to a multiple of this and grouped by that width: the causal
kernel's work grows at most by ``(1 + LENGTH_STEP / length)^2``, and the calls per layer are
at most the distinct widths (``max_seq_len / LENGTH_STEP``), fewer where documents are few."""


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


@dataclass(frozen=True)
class Documents:
    """One length class: documents padded to the same width, one per row.

    ``source [count, width]`` are the flattened ``R*T`` positions each slot reads (past a
    document's end: whatever follows, which only the padding slots after it can see);
    ``target`` where each slot's output goes, ``R*T`` for padding slots (dropped). A class of
    documents of one length lying back to back (one document alone, or a packed row's equal
    documents, which ``packed`` lays side by side) has that width and its ``span``: it is read
    and written in place.
    """

    source: Tensor
    target: Tensor
    span: slice | None = None

    @property
    def count(self) -> int:
        return self.source.shape[0]

    @property
    def width(self) -> int:
        return self.source.shape[1]


def document_classes(begin: Tensor, length: Tensor, size: int, step: int) -> list[Documents]:
    """The documents starting at flattened positions ``begin`` with ``length`` tokens, of rows
    ``size = R*T`` positions in all, grouped by their length rounded up to ``step``; a class
    of back-to-back documents of one length keeps that length, and needs no copy."""
    rounded = (length + step - 1) // step * step
    classes = []
    for w in rounded.unique().tolist():
        picked = rounded == w
        first, own = begin[picked], length[picked]
        exact = int(own.max())
        span = None
        if bool((own == exact).all()) and bool((first.diff() == exact).all()):
            w, start = exact, int(first[0])
            span = slice(start, start + len(first) * exact)
        slots = torch.arange(w, device=begin.device)
        position = first[:, None] + slots  # [count, w]
        target = torch.where(slots < own[:, None], position, size)
        classes.append(Documents(position.clamp(max=size - 1), target, span))
    return classes


@dataclass
class DocumentLayout:
    """A micro-batch's documents: where each starts, its length classes and its tiles.

    Built once per micro-batch; the classes, and the tiles of each window size (``None`` for
    full layers) with their additive masks, are built on first use and shared by every layer
    that needs them.
    """

    starts: Tensor
    """``[R, T]``: each position's document start (padding runs count as documents)."""
    begin: Tensor
    """Flattened first positions of the real documents (padding runs are left out)."""
    length: Tensor
    longest: int
    """The longest real document (0 without any): read once, not at every layer."""
    tile: int = QUERY_TILE
    _documents: list[Documents] | None = None
    _tiles: dict[int | None, list[Tiles]] = field(default_factory=dict)
    _masks: dict[tuple[int | None, torch.dtype], list[Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, document_ids: Tensor) -> DocumentLayout:
        """The layout of rows of ``document_ids [R, T]`` (-1 on padding)."""
        R, T = document_ids.shape
        starts = document_starts(document_ids)
        runs = torch.nonzero((starts == torch.arange(T, device=starts.device)).flatten())[:, 0]
        ends = torch.cat([runs[1:], runs.new_full((1,), R * T)])
        real = document_ids.flatten()[runs] >= 0
        length = (ends - runs)[real]
        longest = int(length.max()) if length.numel() else 0
        return cls(starts, runs[real], length, longest, min(QUERY_TILE, T))

    def fits(self, window: int | None) -> bool:
        """Whether no document outgrows ``window``: then it changes nothing."""
        return window is None or self.longest <= window

    def documents(self) -> list[Documents]:
        if self._documents is None:
            size = self.starts.numel()
            self._documents = document_classes(self.begin, self.length, size, LENGTH_STEP)
        return self._documents

    def tiles(self, window: int | None) -> list[Tiles]:
        if window not in self._tiles:
            self._tiles[window] = tile_keys(self.starts, window, self.tile)
        return self._tiles[window]

    def masks(self, window: int | None, dtype: torch.dtype) -> list[Tensor]:
        """The tiles' masks in additive form: SDPA would convert a boolean one at every layer."""
        if (window, dtype) not in self._masks:
            tiles = self.tiles(window)
            self._masks[window, dtype] = [additive_mask(~t.mask, dtype) for t in tiles]
        return self._masks[window, dtype]


def one_document_per_row(document_ids: Tensor) -> bool:
    """Whether every row holds one document from position 0, then padding.

    Such rows need no mask: the real tokens attend only to earlier real tokens under plain
    causal attention, and padding features are zeroed anyway, so SDPA runs its causal kernel
    with no ``T x T`` tensor at all, provided the positions run on through the padding (see
    ``target_features``). Packed rows go through ``target_attention`` instead.
    """
    real = document_ids >= 0
    return bool((document_ids[real] == 0).all() and not (real[:, 1:] & ~real[:, :-1]).any())


def packing(document_ids: Tensor, windows: tuple[int, ...] = ()) -> DocumentLayout | bool:
    """How ``target_features`` runs these rows: False where each holds one document, else their
    :class:`DocumentLayout` with its length classes and the tiles of the ``windows`` some
    document outgrows already built.

    Reading the layout takes host reads of the document ids; the DataLoader workers call this on
    CPU tensors, so that the feature pass reads nothing back from the device.
    """
    if one_document_per_row(document_ids):
        return False
    layout = DocumentLayout.of(document_ids)
    layout.documents()
    for window in windows:
        if not layout.fits(window):
            layout.tiles(window)
    return layout
