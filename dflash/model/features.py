"""Target features: the hidden states the drafter is conditioned on.

DFlash reads the outputs of ``n`` target decoder layers spread from the second layer to the
third-to-last and concatenates them, so the drafter sees both shallow and deep views of the
context. Rows may be packed with several documents; the target must then attend only inside a
document, with positions restarting at each document, so a packed row yields exactly the
features its documents would yield one by one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def target_layer_ids(num_layers: int, n: int) -> list[int]:
    """Indices of the target layers whose outputs are fused, ``round(1 + i*(L-4)/(n-1))``.

    With a single feature (``n == 1``) the rule is undefined; the middle layer ``L // 2`` is the
    natural single view (the choice of the public DFlash inference code).
    """
    if n < 1:
        raise ValueError(f"number of target features n = {n}: must be at least 1")
    if num_layers < 4 and n > 1:
        raise ValueError(f"num_layers = {num_layers}: the spread rule needs at least 4 layers")
    if n == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) != n:
        raise ValueError(
            f"n = {n} target features from {num_layers} layers repeat a layer ({ids}); "
            f"use at most {num_layers - 3}"
        )
    return ids


def select_features(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """Concatenate decoder-layer outputs (``hidden_states[0]`` is the embedding: layer i is i+1)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def document_attention_mask(document_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive ``[R, 1, T, T]`` mask: causal and inside one document.

    Padding (document -1) attends to earlier padding, which keeps its hidden states finite; they
    are zeroed afterwards anyway. An additive float mask works for eager and SDPA attention alike.
    """
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    allowed = causal & (document_ids[:, :, None] == document_ids[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    document_ids: Tensor,
    layer_ids: list[int],
) -> Tensor:
    """Features ``[R, T, n*H]`` of a micro-batch of (possibly packed) rows; zero on padding."""
    if not (input_ids.shape == position_ids.shape == document_ids.shape) or input_ids.ndim != 2:
        raise ValueError(
            "input_ids, position_ids and document_ids must all be [R, T]; got "
            f"{tuple(input_ids.shape)}, {tuple(position_ids.shape)}, {tuple(document_ids.shape)}"
        )
    dtype = next(target.parameters()).dtype
    out = target(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=document_attention_mask(document_ids, dtype),
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=1,
    )
    features = select_features(out.hidden_states, layer_ids)
    return features * (document_ids >= 0)[..., None].to(features.dtype)
