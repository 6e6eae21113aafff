"""The target's attention over packed rows: causal inside each document, and nothing else.

A packed row handed to SDPA with a block-diagonal mask scores all ``T x T`` pairs, then masks
most of them away, and it loses the causal kernel's skipping of the upper triangle: a row of
512 tokens holding four documents does about eight times the work its documents need. Here
each document runs causal SDPA on its own slice of the row (what varlen flash attention does
on a GPU), so a packed row costs what its documents cost one by one, with no mask at all.

The function is registered with Hugging Face's attention interfaces under ``NAME`` and is
switched on only for the feature pass over packed rows (``document_attention``); the
document spans reach it as a keyword argument of the model's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from dflash.model.attention import document_starts

NAME = "dflash_documents"

Spans = list[list[tuple[int, int]]]
"""Per row, the ``(start, end)`` of each document, in row order."""


def document_spans(document_ids: Tensor) -> Spans:
    """The documents of each row as ``(start, end)`` slices; padding (id -1) belongs to none.

    A document is a run of equal ids, as :func:`~dflash.model.attention.document_starts`
    finds them; its span ends after its last position.
    """
    T = document_ids.shape[1]
    spans: Spans = []
    starts_of = document_starts(document_ids).tolist()
    for ids, starts in zip(document_ids.tolist(), starts_of, strict=True):
        ends = [t for t in range(T) if t + 1 == T or starts[t + 1] != starts[t]]
        spans.append([(starts[t], t + 1) for t in ends if ids[t] >= 0])
    return spans


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    document_spans: Spans,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal SDPA per document of ``query/key/value [R, heads, T, D]``; zeros on padding.

    Returns ``[R, T, heads, D]`` as Hugging Face attention functions do. Dropout, sliding
    windows and the (absent) mask are ignored: the target is frozen and in eval mode, and the
    former block-diagonal mask ignored sliding windows as well.
    """
    gqa = query.shape[1] != key.shape[1]
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for r, spans in enumerate(document_spans):
        for start, end in spans:
            o = F.scaled_dot_product_attention(
                query[r : r + 1, :, start:end],
                key[r : r + 1, :, start:end],
                value[r : r + 1, :, start:end],
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )
            out[r, start:end] = o[0].transpose(0, 1)
    return out, None


def no_mask(*args, **kwargs) -> None:
    """The mask builder for ``NAME``: the spans say everything, so no mask is ever built."""
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
