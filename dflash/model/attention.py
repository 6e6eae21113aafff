"""The DFlash training mask and the attention kernel that applies it.

Queries are the ``A`` blocks of ``block_size`` slots laid end to end (``A*bs`` queries); keys are
the row's ``T`` context features followed by the same blocks (``T + A*bs`` keys). A block slot may
see:

- context position ``j`` iff ``j < anchor`` — strictly: at inference the target has not yet
  run on the anchor token, and its features there already encode the token after it — and
  ``j`` lies in the anchor's document (packed rows never leak);
- every slot of its own block (bidirectional), and nothing of any other block.

Padded blocks (anchor -1) see nothing. The rule exists twice with one meaning: a dense boolean
mask for ``scaled_dot_product_attention`` (CPU, tests) and a block-sparse FlexAttention
``BlockMask`` on CUDA, where most of the ``A*bs x A*bs`` block-to-block square is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: the SDPA path still works everywhere
    BlockMask = None


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
    """Dense boolean mask ``[R, A*bs, T + A*bs]``, True where a query may attend."""
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

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        block = q // block_size
        anchor = anchors[b, block]
        j = kv.clamp(max=context_len - 1)
        doc = document_ids[b, j]
        sees_context = (kv < anchor) & (doc == anchor_doc[b, block]) & (doc >= 0)
        sees_block = (kv - context_len) // block_size == block
        return (anchor >= 0) & torch.where(kv < context_len, sees_context, sees_block)

    return mask_mod


def flex_available(device: torch.device) -> bool:
    return BlockMask is not None and device.type == "cuda"


def build_attention_mask(
    anchors: Tensor,
    document_ids: Tensor,
    block_size: int,
    context_len: int,
    flex: bool | None = None,
) -> Tensor | BlockMask:
    """A FlexAttention ``BlockMask`` on CUDA, the dense boolean mask elsewhere.

    ``flex`` forces one kind (checks compare the two); None chooses by device.
    """
    if flex is None:
        flex = flex_available(anchors.device)
    if not flex:
        return build_block_mask(anchors, document_ids, block_size, context_len)
    R, A = anchors.shape
    mask_mod = block_mask_mod(anchors, document_ids, block_size, context_len)
    return create_block_mask(
        mask_mod,
        B=R,
        H=None,
        Q_LEN=A * block_size,
        KV_LEN=context_len + A * block_size,
        device=anchors.device,
    )


@cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    """Compiled once per process: eager FlexAttention is a slow reference implementation."""
    return torch.compile(flex_attention)


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | BlockMask | None, scale: float
) -> Tensor:
    """Attention of ``q [B, H, Q, d]`` over ``k, v [B, Hkv, K, d]`` (grouped heads allowed).

    With a boolean mask, queries that may see nothing would make SDPA return NaN; they attend
    uniformly instead and their output is zeroed, so values and gradients stay finite.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)  # autocast may leave the normed keys in fp32
    gqa = q.shape[1] != k.shape[1]
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    blind = ~mask.any(dim=-1, keepdim=True)  # [B, Q, 1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=(mask | blind)[:, None], scale=scale, enable_gqa=gqa
    )
    return out.masked_fill(blind[:, None], 0.0)
