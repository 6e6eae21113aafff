"""The DFlash training attention rule, and the kernels that apply it.

Queries are the ``A`` blocks of ``block_size`` slots laid end to end (``A*bs`` queries); keys are
the row's ``T`` context features and the same blocks. A block slot may see:

- context position ``j`` iff ``j < anchor`` — strictly: at inference the target has not yet
  run on the anchor token, and its features there already encode the token after it — and
  ``j`` lies in the anchor's document (packed rows never leak);
- every slot of its own block (bidirectional), and nothing of any other block.

Padded blocks (anchor -1) see nothing and output 0. On CUDA the rule is a block-sparse
FlexAttention ``BlockMask``. Elsewhere it is applied in two parts that are merged exactly by
their log-sum-exp: each block over its own ``bs`` slots (a tiny ``[A, bs, bs]`` square), and
chunks of anchors over the context window they can see (torch's fused flash-attention kernel
on CPU), recomputed in backward. So neither the ``(A*bs)^2`` block square nor an ``A*bs x T``
score matrix for all anchors ever exists.
:func:`build_block_mask`, the same rule as one dense boolean mask, is the reference they are
tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental import _config as shape_config

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch without FlexAttention: the other paths still work everywhere
    BlockMask = None

CONTEXT_SCORES_PER_CHUNK = 1 << 18
"""Context scores per head (rows x anchors x bs x window) computed together: a chunk's scores
stay within 1 MiB of fp32 per head whatever the number of anchors (smaller chunks fit the
context windows closer; this size trained fastest on the default)."""

FLEX_TILE = 128
"""Query and key tile of the FlexAttention ``BlockMask`` (its kernels' default block)."""


def whole_tiles(length: int) -> int:
    """``length`` padded to whole FlexAttention tiles, two at least: queries and keys are passed
    this long. A compiled kernel is specialised for a length of one tile, so one-tile lengths
    would cost a second compile."""
    return max(-(-length // FLEX_TILE), 2) * FLEX_TILE


SPARSE_FAR = 1 << 62
"""A position past any row: the start of an anchor that sees nothing, for minima."""

HIDDEN = torch.finfo(torch.float32).min
"""Score of a key a query may not see: finite, so a query that sees nothing stays finite."""

FUSED_ON_CPU = True
"""Run the context chunks on torch's fused flash-attention CPU kernel: several times faster
than the same math in plain torch ops, which runs elsewhere and is its tested twin."""

KV = tuple[Tensor, Tensor]


def _check(anchors: Tensor, document_ids: Tensor, context_len: int) -> None:
    if anchors.ndim != 2 or document_ids.ndim != 2 or anchors.shape[0] != document_ids.shape[0]:
        raise ValueError(
            f"anchors [R, A] and document_ids [R, T] disagree: {tuple(anchors.shape)} vs "
            f"{tuple(document_ids.shape)}"
        )
    if document_ids.shape[1] != context_len:
        raise ValueError(
            f"document_ids has {document_ids.shape[1]} positions, expected {context_len}"
        )


def build_block_mask(
    anchors: Tensor, document_ids: Tensor, block_size: int, context_len: int
) -> Tensor:
    """Dense boolean mask ``[R, A*bs, T + A*bs]``, True where a query may attend (reference)."""
    _check(anchors, document_ids, context_len)
    R, A = anchors.shape
    device = anchors.device
    valid = anchors >= 0  # [R, A]
    anchor_doc = document_ids.gather(1, anchors.clamp(min=0))  # [R, A]
    j = torch.arange(context_len, device=device)
    context = (
        (j[None, None, :] < anchors[:, :, None])
        & (document_ids[:, None, :] == anchor_doc[:, :, None])
        & (document_ids[:, None, :] >= 0)
        & valid[:, :, None]
    )  # [R, A, T]
    own = torch.eye(A, dtype=torch.bool, device=device)[None] & valid[:, :, None]  # [R, A, A]
    context = context.repeat_interleave(block_size, dim=1)
    blocks = own.repeat_interleave(block_size, dim=1).repeat_interleave(block_size, dim=2)
    return torch.cat([context, blocks], dim=2)


def block_mask_mod(
    anchors: Tensor, document_ids: Tensor, block_size: int, context_len: int
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The same rule as :func:`build_block_mask`, as a FlexAttention ``mask_mod``."""
    _check(anchors, document_ids, context_len)
    anchor_doc = document_ids.gather(1, anchors.clamp(min=0))
    # lengths as tensors: a compiled kernel reads them as data, never as constants to guard on
    last_block = torch.tensor(anchors.shape[1] - 1, device=anchors.device)
    context = torch.tensor(context_len, device=anchors.device)

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        block = torch.minimum(q // block_size, last_block)  # a padded query: the last block's
        anchor = anchors[b, block]
        j = torch.minimum(kv, context - 1)
        doc = document_ids[b, j]
        sees_context = (kv < anchor) & (doc == anchor_doc[b, block]) & (doc >= 0)
        sees_block = (kv - context) // block_size == block  # never a padded key
        real = (q // block_size == block) & (anchor >= 0)
        return real & torch.where(kv < context, sees_context, sees_block)

    return mask_mod


@dataclass(frozen=True)
class ContextChunk:
    """Anchors ``[start, stop)`` of every row, and the context window they may see.

    ``positions [R, W]`` are the context positions gathered for each row (the span from the
    first anchor's document start to the last anchor; clamped, past-the-end ones are hidden);
    ``hidden [R, stop - start, W]`` says which of them each anchor may not see.
    """

    start: int
    stop: int
    positions: Tensor
    hidden: Tensor


@dataclass(frozen=True)
class AnchorBlocks:
    """The rule as data for the two-part kernel: which blocks are real, and context chunks.

    Built once per micro-batch and shared by every drafter layer.
    """

    block_size: int
    valid: Tensor  # [R, A] bool
    chunks: tuple[ContextChunk, ...]


def document_starts(document_ids: Tensor) -> Tensor:
    """``[R, T]``: the first position of the run of equal document ids each position is in."""
    T = document_ids.shape[1]
    j = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(new, j, 0).cummax(dim=1).values


def _chunk_bounds(lo: list[int], hi: list[int], scores_per_position: int, budget: int):
    """Greedy runs ``[start, stop)`` of anchor columns sharing a context start ``lo`` (one
    document of a packed row) whose scores, ``anchors x scores_per_position x (max hi - lo)``,
    fit the budget; at least one anchor each. Anchors of the next document would widen the
    window for all of a run's anchors, hence a new run there."""
    bounds, start = [], 0
    while start < len(lo):
        stop, high = start + 1, hi[start]
        while stop < len(lo) and lo[stop] == lo[start]:
            wider = max(high, hi[stop])
            if (stop + 1 - start) * scores_per_position * max(wider - lo[start], 0) > budget:
                break
            high, stop = wider, stop + 1
        bounds.append((start, stop))
        start = stop
    return bounds


def anchor_blocks(
    anchors: Tensor,
    document_ids: Tensor,
    block_size: int,
    context_len: int,
    budget: int,
) -> AnchorBlocks:
    """Cut the anchors into chunks of at most ``budget`` context scores per head, each chunk
    with the narrowest context window per row (from its first document start to its last
    anchor)."""
    _check(anchors, document_ids, context_len)
    R = anchors.shape[0]
    valid = anchors >= 0
    safe = anchors.clamp(min=0)
    anchor_doc = document_ids.gather(1, safe)
    first = document_starts(document_ids).gather(1, safe)
    low = torch.where(valid, first, context_len)
    high = torch.where(valid, anchors, 0)
    column_bounds = (low.amin(dim=0).tolist(), high.amax(dim=0).tolist())
    chunks = []
    for start, stop in _chunk_bounds(*column_bounds, R * block_size, budget):
        a, ok = anchors[:, start:stop], valid[:, start:stop]
        lo = low[:, start:stop].amin(dim=1)
        width = int((high[:, start:stop].amax(dim=1) - lo).clamp(min=0).max())
        if width == 0:  # only first-of-document or padded anchors: no context to see
            continue
        positions = lo[:, None] + torch.arange(width, device=anchors.device)
        positions = positions.clamp(max=context_len - 1)
        doc = document_ids.gather(1, positions)[:, None, :]
        visible = (
            (positions[:, None, :] < a[:, :, None])
            & (doc == anchor_doc[:, start:stop, None])
            & (doc >= 0)
            & ok[:, :, None]
        )
        if visible.any():
            chunks.append(ContextChunk(start, stop, positions, ~visible))
    return AnchorBlocks(block_size, valid, tuple(chunks))


def flex_available(device: torch.device) -> bool:
    return BlockMask is not None and device.type == "cuda"


def build_attention_mask(
    anchors: Tensor,
    document_ids: Tensor,
    block_size: int,
    context_len: int,
    flex: bool | None = None,
) -> AnchorBlocks | BlockMask:
    """A FlexAttention ``BlockMask`` on CUDA, :class:`AnchorBlocks` for the two-part kernel
    elsewhere. ``flex`` forces one kind (checks compare the two); None chooses by device."""
    if flex is None:
        flex = flex_available(anchors.device)
    if not flex:
        return anchor_blocks(
            anchors, document_ids, block_size, context_len, CONTEXT_SCORES_PER_CHUNK
        )
    return flex_block_mask(anchors, document_ids, block_size, context_len)


def _per_query_tile(values: Tensor, block_size: int, n_tiles: int, reduce: str) -> Tensor:
    """Per-anchor ``values [R, A]`` reduced (``amin`` or ``amax``) over the anchors whose slots
    fall in each query tile: ``[R, n_tiles]``."""
    R, A = values.shape
    out = values.new_full((R, n_tiles), SPARSE_FAR if reduce == "amin" else 0)
    anchor = torch.arange(A, device=values.device) * block_size
    for offset in sorted({*range(0, block_size, FLEX_TILE), block_size - 1}):
        tile = ((anchor + offset) // FLEX_TILE).expand(R, A)
        out.scatter_reduce_(1, tile, values, reduce)
    return out


def _tiles(
    anchors: Tensor, document_ids: Tensor, block_size: int, context_len: int, n_q: int, n_kv: int
) -> tuple[Tensor, Tensor]:
    """Which key tiles each query tile sees in part and wholly, ``[R, n_q, n_kv]`` each.

    An anchor sees the context ``[start of its document run, anchor)`` (nothing if it or its
    document is padding) and its own ``bs`` block slots. A query tile sees a key tile wholly iff
    every anchor in it does: its latest start is at or before the tile and its earliest anchor
    after it. It sees it in part if the span from its earliest start to its latest anchor, or of
    its real blocks, meets the tile: a gap between two documents counts, which costs a tile of
    ``mask_mod`` at most, never a wrong pair.
    """
    A = anchors.shape[1]
    safe = anchors.clamp(min=0)
    start = document_starts(document_ids).gather(1, safe)
    sees = (anchors >= 0) & (document_ids.gather(1, safe) >= 0) & (start < anchors)
    low, high = torch.where(sees, start, SPARSE_FAR), torch.where(sees, anchors, 0)
    own = context_len + torch.arange(A, device=anchors.device) * block_size
    own_low = torch.where(anchors >= 0, own, SPARSE_FAR)
    own_high = torch.where(anchors >= 0, own + block_size, 0)

    def tile(values: Tensor, reduce: str) -> Tensor:
        return _per_query_tile(values, block_size, n_q, reduce)[..., None]

    first = torch.arange(n_kv, device=anchors.device) * FLEX_TILE
    last = first + FLEX_TILE
    full = (tile(low, "amax") <= first) & (last <= tile(high, "amin"))
    some = torch.maximum(tile(low, "amin"), first) < torch.minimum(tile(high, "amax"), last)
    some |= torch.maximum(tile(own_low, "amin"), first) < torch.minimum(
        tile(own_high, "amax"), last
    )
    return some & ~full, full


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """A tile matrix ``[R, Qt, Kt]`` as FlexAttention's per-row counts and column lists."""
    dense = dense[:, None].to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def flex_block_mask(
    anchors: Tensor, document_ids: Tensor, block_size: int, context_len: int
) -> BlockMask:
    """The rule as a FlexAttention ``BlockMask`` built from tiles, never from pairs.

    ``create_block_mask`` evaluates ``mask_mod`` on every query-key pair (10 bytes a pair:
    13 GB at 32K queries and 41K keys); here each anchor's visible context is an interval,
    so a ``[R, query tiles, key tiles]`` comparison says which tiles are full (no mask needed),
    partial (``mask_mod`` applied inside) or skipped. Assumes a document's positions are one run, as
    :func:`anchor_blocks` does. No host read: it runs on the device as well.
    """
    _check(anchors, document_ids, context_len)
    R, A = anchors.shape
    q_len, kv_len = whole_tiles(A * block_size), whole_tiles(context_len + A * block_size)
    n_q, n_kv = q_len // FLEX_TILE, kv_len // FLEX_TILE
    partial, full = _tiles(anchors, document_ids, block_size, context_len, n_q, n_kv)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=block_mask_mod(anchors, document_ids, block_size, context_len),
        seq_lengths=(q_len, kv_len),
    )


COMPILE_OPTIONS = {"cuda": {"dynamic": True}, "cpu": {"dynamic": False}}
"""``torch.compile`` options of FlexAttention per device type. Dynamic lengths compile once for
every micro-batch; on CPU, where it only serves checks, torch 2.13's kernel template does not
build with symbolic lengths, so it compiles per shape there."""


@cache
def _compiled_flex_attention(device_type: str) -> Callable[..., Tensor]:
    """Compiled once per process: eager FlexAttention is a slow reference implementation, and
    compiling per shape would recompile at every micro-batch until torch runs it eagerly."""
    return torch.compile(flex_attention, **COMPILE_OPTIONS.get(device_type, {"dynamic": True}))


def flex_compiles() -> int:
    """Graphs ``torch.compile`` has built in this process; only FlexAttention is compiled
    here, so a count that grows past 1-2 means it recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _padded(x: Tensor, length: int) -> Tensor:
    """``x [B, H, L, d]`` zero-padded to ``length`` positions (whole tiles; masked out)."""
    return F.pad(x, (0, 0, 0, length - x.shape[2])) if length > x.shape[2] else x


def flex_attend(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scale: float) -> Tensor:
    """Compiled FlexAttention with queries, keys and values padded to the mask's whole tiles,
    so lengths come in steps of ``FLEX_TILE``; the padding is sliced off."""
    q_len, kv_len = mask.seq_lengths
    # equal lengths (say rows = kv heads = 2) would share one symbol: a guard that they stay equal
    with shape_config.patch(use_duck_shape=False):
        out = _compiled_flex_attention(q.device.type)(
            _padded(q, q_len),
            _padded(k, kv_len),
            _padded(v, kv_len),
            block_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return out[:, :, : q.shape[2]]


def _window(x: Tensor, positions: Tensor) -> Tensor:
    """Rows' context windows ``[R, Hkv, W, d]`` of keys or values ``x [R, Hkv, T, d]``."""
    R, Hkv, _, d = x.shape
    return x.gather(2, positions[:, None, :, None].expand(R, Hkv, positions.shape[1], d))


def _scores(q: Tensor, k: Tensor, hidden: Tensor, scale: float) -> Tensor:
    """fp32 scores ``[R, Hkv, M, W]`` of queries ``q [R, Hkv, M, d]``; ``hidden [R, 1, M, W]``."""
    scores = torch.matmul(q * scale, k.transpose(2, 3)).float()
    return scores.masked_fill_(hidden, HIDDEN)


def _forward_math(q, k, v, hidden, scale):
    """Output ``[R, Hkv, M, d]`` and log-sum-exp ``[R, Hkv, M]`` of queries ``[R, Hkv, M, d]``."""
    scores = _scores(q, k, hidden, scale)
    top = scores.amax(dim=-1, keepdim=True)
    probs = scores.sub_(top).exp_()  # unnormalised, in place: one buffer per chunk
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.to(v.dtype), v) / total
    return out.to(v.dtype), (top + total.log()).squeeze(-1)


def _backward_math(q, k, v, hidden, scale, out, lse, d_out, d_lse):
    """Gradients of ``q, k, v``; the log-sum-exp's enters as ``ds = p (dO.v - rowsum(dO out)
    + dlse)``."""
    probs = _scores(q, k, hidden, scale).sub_(lse[..., None]).exp_()
    d_v = torch.matmul(probs.transpose(2, 3).to(v.dtype), d_out)
    d_probs = torch.matmul(d_out, v.transpose(2, 3)).float()
    row = (d_out.float() * out.float()).sum(dim=-1) - d_lse
    d_scores = d_probs.sub_(row[..., None]).mul_(probs).to(q.dtype)
    return torch.matmul(d_scores, k) * scale, torch.matmul(d_scores.transpose(2, 3), q * scale), d_v


def additive_mask(hidden: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive form of a mask, ``dtype``'s minimum where ``hidden``, which SDPA's fused
    kernels take as is (a boolean mask they convert at every call)."""
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return bias.masked_fill_(hidden, torch.finfo(dtype).min)


def _fused_bias(q: Tensor, hidden: Tensor) -> Tensor:
    """The additive ``[R, 1, M, W]`` mask the fused kernel takes."""
    return additive_mask(hidden, q.dtype)


def _query_rows(hidden: Tensor, shape: torch.Size) -> Tensor:
    """``hidden [R, c, W]`` per query row ``[R, 1, M, W]``, the rows being ``(G, c, bs)``."""
    R, _, G, c, bs, _ = shape
    W = hidden.shape[-1]
    return hidden[:, None, None, :, None, :].expand(R, 1, G, c, bs, W).reshape(R, 1, -1, W)


def _forward_fused(q, k, v, hidden, scale):
    """:func:`_forward_math` by torch's fused CPU flash-attention kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=_fused_bias(q, hidden), scale=scale
    )


def _backward_fused(q, k, v, hidden, scale, out, lse, d_out, d_lse):
    """:func:`_backward_math` by the fused CPU kernel. The kernel knows no log-sum-exp gradient;
    one extra head-dim column carries it: with ``out`` extended by ``-dlse``, ``dO`` by 1 and
    ``q, k, v`` by 0, its ``rowsum(dO * out)`` becomes ``rowsum(dO * out) - dlse`` and nothing
    else changes."""

    def extend(x: Tensor, value: Tensor | float) -> Tensor:
        column = x.new_zeros(x.shape[:-1] + (1,)).add_(value)
        return torch.cat([x, column], dim=-1)

    d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        extend(d_out, 1.0),
        extend(q, 0.0),
        extend(k, 0.0),
        extend(v, 0.0),
        extend(out, -d_lse[..., None].to(out.dtype)),
        lse,
        0.0,
        False,
        attn_mask=_fused_bias(q, hidden),
        scale=scale,
    )
    return d_q[..., :-1], d_k[..., :-1], d_v[..., :-1]


def _flat(x: Tensor) -> Tensor:
    """``[R, Hkv, G, c, bs, ...]`` with the query rows ``(G, c, bs)`` as one axis."""
    return x.reshape(*x.shape[:2], -1, *x.shape[5:])


class ContextAttention(torch.autograd.Function):
    """Every anchor over its context window, chunk by chunk: the output and the log-sum-exp.

    Flash-attention style: only the inputs, output and log-sum-exp are kept; the backward
    recomputes each chunk's probabilities and gathers the key and value gradients into one
    buffer. The merge differentiates the log-sum-exp too. A query that sees nothing gets a
    log-sum-exp near the dtype's minimum: no weight in the merge, zero gradients from it.
    """

    @staticmethod
    def forward(ctx, q, k, v, chunks, scale):
        fused = FUSED_ON_CPU and q.device.type == "cpu"
        kernel = _forward_fused if fused else _forward_math
        out = q.new_zeros(q.shape)
        lse_dtype = torch.promote_types(q.dtype, torch.float32)  # the kernels' log-sum-exp
        lse = q.new_full(q.shape[:-1], HIDDEN, dtype=lse_dtype)
        for chunk in chunks:
            part = slice(chunk.start, chunk.stop)
            q_part = q[:, :, :, part]
            rows = _query_rows(chunk.hidden, q_part.shape)
            o, s = kernel(
                _flat(q_part), _window(k, chunk.positions), _window(v, chunk.positions), rows, scale
            )
            out[:, :, :, part] = o.reshape(q_part.shape)
            lse[:, :, :, part] = s.reshape(q_part.shape[:-1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale, ctx.fused = chunks, scale, fused
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        kernel = _backward_fused if ctx.fused else _backward_math
        d_q, d_k, d_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for chunk in ctx.chunks:
            part = slice(chunk.start, chunk.stop)
            q_part = q[:, :, :, part]
            grads = kernel(
                _flat(q_part),
                _window(k, chunk.positions),
                _window(v, chunk.positions),
                _query_rows(chunk.hidden, q_part.shape),
                ctx.scale,
                _flat(out[:, :, :, part]),
                _flat(lse[:, :, :, part]),
                _flat(d_out[:, :, :, part]).contiguous(),
                _flat(d_lse[:, :, :, part]),
            )
            d_q[:, :, :, part] = grads[0].reshape(q_part.shape)
            index = chunk.positions[:, None, :, None].expand(*grads[1].shape)
            d_k.scatter_add_(2, index, grads[1])
            d_v.scatter_add_(2, index, grads[2])
        return d_q, d_k, d_v, None, None


def _own_blocks(q: Tensor, block_kv: KV, scale: float) -> tuple[Tensor, Tensor]:
    """Every block over its own ``bs`` slots, all anchors at once: ``[R, Hkv, G, A, bs, bs]``."""
    R, Hkv, G, A, bs, d = q.shape
    k, v = (t.view(R, Hkv, 1, A, bs, d) for t in block_kv)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


def _context(
    q: Tensor, context_kv: KV, blocks: AnchorBlocks, scale: float
) -> tuple[Tensor, Tensor]:
    """Context output and log-sum-exp of every anchor, chunk by chunk."""
    return ContextAttention.apply(q, *context_kv, blocks.chunks, scale)


def two_part_attention(
    q: Tensor, context_kv: KV, block_kv: KV, blocks: AnchorBlocks, scale: float
) -> Tensor:
    """The training rule without a dense mask: context and own-block parts merged by their
    log-sum-exp, ``out = Σ exp(lse_i - lse) * out_i``; padded blocks output 0."""
    R, H, Q, d = q.shape
    Hkv, bs = context_kv[0].shape[1], blocks.block_size
    q = q.view(R, Hkv, H // Hkv, Q // bs, bs, d)
    out_blocks, lse_blocks = _own_blocks(q, block_kv, scale)
    out_context, lse_context = _context(q, context_kv, blocks, scale)
    lse = torch.logaddexp(lse_blocks, lse_context)
    out = (
        torch.exp(lse_blocks - lse)[..., None] * out_blocks
        + torch.exp(lse_context - lse)[..., None] * out_context
    )
    out = out * blocks.valid[:, None, None, :, None, None]
    return out.to(q.dtype).view(R, H, Q, d)


def attend(
    q: Tensor,
    context_kv: KV,
    block_kv: KV,
    mask: AnchorBlocks | BlockMask | Tensor | None,
    scale: float,
) -> Tensor:
    """Attention of the block queries ``q [B, H, Q, d]`` over the context and block keys and
    values (each ``[B, Hkv, ., d]``; grouped heads allowed).

    ``mask`` is the training rule (:class:`AnchorBlocks` or a FlexAttention ``BlockMask``), a
    dense boolean ``[B, Q, C + Q]`` mask (the reference), or None: every query sees every key.
    """
    if isinstance(mask, AnchorBlocks):
        return two_part_attention(q, context_kv, block_kv, mask, scale)
    k = torch.cat([context_kv[0], block_kv[0]], dim=2)
    v = torch.cat([context_kv[1], block_kv[1]], dim=2)
    gqa = q.shape[1] != k.shape[1]
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex_attend(q, k, v, mask, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    return dense_attention(q, k, v, mask, scale)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA with a dense boolean mask ``[B, Q, K]``: the reference of the two-part kernel.

    Queries that may see nothing would make SDPA return NaN; they attend uniformly instead and
    their output is zeroed, so values and gradients stay finite.
    """
    gqa = q.shape[1] != k.shape[1]
    blind = ~mask.any(dim=-1, keepdim=True)  # [B, Q, 1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=(mask | blind)[:, None], scale=scale, enable_gqa=gqa
    )
    return out.masked_fill(blind[:, None], 0.0)
