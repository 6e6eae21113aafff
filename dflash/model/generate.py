"""Greedy speculative decoding with a DFlash drafter, and the plain greedy reference.

Each step the drafter fills a whole block ``[last, MASK x (bs-1)]`` in one forward pass; the
target checks all of it in one forward pass with its KV cache. The longest prefix of drafts that
agrees with the target's own argmax is kept, plus the target's next token (the bonus), so every
step commits at least one token and the output is exactly the target's greedy output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from dflash.model.drafter import ContextCache, DFlashDrafter
from dflash.model.features import select_features


@dataclass
class GenerateOutput:
    tokens: list[int] = field(default_factory=list)
    """New tokens (prompt excluded), at most ``max_new_tokens``, ending at a stop token if any."""
    accepted: list[int] = field(default_factory=list)
    """Tokens committed by each verifying target forward (bonus included): τ = mean(accepted).
    The prefill's first token is not counted, so ``len(tokens) == 1 + sum(accepted)``."""


def _prompt(prompt_ids: list[int] | Tensor, device: torch.device) -> Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    return ids[None]


def _crop(cache: DynamicCache, length: int) -> None:
    """Drop cached positions ``>= length`` (``crop`` takes a negative count to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 0")


@torch.no_grad()
def greedy_generate(
    target: nn.Module,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The target's own greedy continuation, one token per forward: the lossless reference."""
    _check_budget(max_new_tokens)
    ids = _prompt(prompt_ids, target.device)
    cache = DynamicCache(config=target.config)
    tokens: list[int] = []
    position = 0
    while len(tokens) < max_new_tokens and not (tokens and tokens[-1] in stop_token_ids):
        positions = torch.arange(position, position + ids.shape[1], device=ids.device)[None]
        logits = target(
            input_ids=ids, position_ids=positions, past_key_values=cache, logits_to_keep=1
        ).logits
        position += ids.shape[1]
        tokens.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([tokens[-1:]], device=ids.device)
    return tokens


@torch.no_grad()
def dflash_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> GenerateOutput:
    """Greedy speculative decoding, batch size 1; ``tokens`` equal :func:`greedy_generate`."""
    _check_budget(max_new_tokens)
    out = GenerateOutput()
    if max_new_tokens == 0:
        return out
    ids = _prompt(prompt_ids, target.device)
    device, bs, layer_ids = ids.device, drafter.config.block_size, drafter.config.target_layer_ids
    start = ids.shape[1]  # position of the newest token, committed but not yet seen by the target
    target_cache, drafter_cache = DynamicCache(config=target.config), ContextCache()
    prefill = target(
        input_ids=ids,
        position_ids=torch.arange(start, device=device)[None],
        past_key_values=target_cache,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    features = select_features(prefill.hidden_states, layer_ids)
    context_positions = torch.arange(start, device=device)[None]
    out.tokens.append(int(prefill.logits[0, -1].argmax()))

    while len(out.tokens) < max_new_tokens and out.tokens[-1] not in stop_token_ids:
        block = torch.full((1, bs), drafter.config.mask_token_id, device=device)
        block[0, 0] = out.tokens[-1]
        block_positions = torch.arange(start, start + bs, device=device)[None]
        hidden = drafter(block, block_positions, features, context_positions, cache=drafter_cache)
        block[0, 1:] = drafter.logits(hidden[:, 1:]).argmax(dim=-1)[0]

        size = min(bs, max_new_tokens - len(out.tokens))  # never commit past the budget
        verify = target(
            input_ids=block[:, :size],
            position_ids=block_positions[:, :size],
            past_key_values=target_cache,
            output_hidden_states=True,
        )
        greedy = verify.logits[0].argmax(dim=-1)
        agree = (block[0, 1:size] == greedy[: size - 1]).long().cumprod(dim=0).sum()
        new = greedy[: int(agree) + 1].tolist()
        for i, token in enumerate(new):
            if token in stop_token_ids:
                new = new[: i + 1]
                break

        out.tokens.extend(new)
        out.accepted.append(len(new))
        committed = len(new)  # block[:committed] are now known-good inputs the target has seen
        features = select_features(verify.hidden_states, layer_ids)[:, :committed]
        context_positions = block_positions[:, :committed]
        start += committed
        _crop(target_cache, start)
    return out
