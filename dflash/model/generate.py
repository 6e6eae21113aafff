"""Greedy speculative decoding through one verifier, and the plain greedy reference.

Each step a proposer drafts up to ``bs - 1`` tokens after the newest committed token; the
target checks ``[last, drafts...]`` in one forward pass with its KV cache. The longest prefix
of drafts that agrees with the target's own argmax is kept, plus the target's next token (the
bonus), so every step commits at least one token and the output is exactly the target's
greedy output whoever proposes. The DFlash drafter fills a whole block in one forward pass;
the n-gram baseline (:mod:`dflash.eval.ngram`) looks the drafts up in the text so far.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from dflash.model.drafter import ContextCache, DFlashDrafter, drafter_autocast
from dflash.model.shipped import kv, select_features


@dataclass
class GenerateOutput:
    tokens: list[int] = field(default_factory=list)
    """New tokens (prompt excluded), at most ``max_new_tokens``, ending at a stop token if any."""
    accepted: list[int] = field(default_factory=list)
    """Tokens committed by each verifying target forward (bonus included): τ = mean(accepted).
    The prefill's first token is not counted, so ``len(tokens) == 1 + sum(accepted)``."""
    full: list[bool] = field(default_factory=list)
    """Per step: the whole block could be used (not cut by ``max_new_tokens`` or a stop token),
    so its rejected slots are real rejections."""
    agreed: list[int] = field(default_factory=list)
    """Per step: 1 + the leading drafts the target agreed with over the whole block, even past a
    stop token or the budget; z-lab's ``dflash_generate`` counts τ this way."""
    prefill_s: float = field(default=0.0, compare=False)
    """Seconds of the prompt's forward pass, which also yields the first token."""
    decode_s: float = field(default=0.0, compare=False)
    """Seconds after the prefill: drafting and verifying every later token."""


class Proposer(Protocol):
    """What the verifier asks of a drafter; ``uses_features`` asks for target hidden states."""

    uses_features: bool

    def start(self, hidden_states: tuple[Tensor, ...] | None, length: int) -> None: ...

    def propose(self, history: list[int], position: int) -> list[int]: ...

    def commit(
        self, hidden_states: tuple[Tensor, ...] | None, position: int, count: int
    ) -> None: ...


class DrafterProposer:
    """A DFlash drafter as a proposer: it fills ``[last, MASK x (bs-1)]`` in one pass.

    Target features of committed tokens enter its context cache once; the block's own keys are
    recomputed every step, so rejected drafts never enter the cache.
    """

    uses_features = True

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.cache = ContextCache()
        self.features: Tensor | None = None
        self.context_positions: Tensor | None = None

    def start(self, hidden_states: tuple[Tensor, ...] | None, length: int) -> None:
        self.cache = ContextCache()
        self.features = select_features(hidden_states, self.drafter.config.target_layer_ids)
        self.context_positions = torch.arange(length, device=self.features.device)[None]

    def propose(self, history: list[int], position: int) -> list[int]:
        """Always a whole block, as in training, even where fewer drafts can be verified."""
        device, c = self.features.device, self.drafter.config
        block = torch.full((1, c.block_size), c.mask_token_id, device=device)
        block[0, 0] = history[-1]
        positions = torch.arange(position, position + c.block_size, device=device)[None]
        with drafter_autocast(device):
            hidden = self.drafter(
                block, positions, self.features, self.context_positions, cache=self.cache
            )
            drafts = self.drafter.logits(hidden[:, 1:]).argmax(dim=-1)[0]
        self.features = self.context_positions = None  # in the cache now
        return drafts.tolist()

    def commit(self, hidden_states: tuple[Tensor, ...] | None, position: int, count: int) -> None:
        """Keep the committed tokens' features for the next draft (with any not drafted yet)."""
        new = select_features(hidden_states, self.drafter.config.target_layer_ids)[:, :count]
        positions = torch.arange(position, position + count, device=new.device)[None]
        if self.features is not None:
            new = torch.cat([self.features, new], dim=1)
            positions = torch.cat([self.context_positions, positions], dim=1)
        self.features, self.context_positions = new, positions


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


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def greedy_decode(
    target: nn.Module,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> GenerateOutput:
    """The target's own greedy continuation, one token per forward: the lossless reference."""
    _check_budget(max_new_tokens)
    ids = _prompt(prompt_ids, target.device)
    cache = DynamicCache(config=target.config)
    past = kv(target, cache)
    out = GenerateOutput()
    position = 0
    began = _clock(ids.device)
    while len(out.tokens) < max_new_tokens and not (
        out.tokens and out.tokens[-1] in stop_token_ids
    ):
        positions = torch.arange(position, position + ids.shape[1], device=ids.device)[None]
        logits = target(input_ids=ids, position_ids=positions, logits_to_keep=1, **past).logits
        position += ids.shape[1]
        out.tokens.append(int(logits[0, -1].argmax()))
        if len(out.tokens) == 1:
            out.prefill_s = _clock(ids.device) - began
        else:
            out.accepted.append(1)
            out.full.append(True)
            out.agreed.append(1)
        ids = torch.tensor([out.tokens[-1:]], device=ids.device)
    out.decode_s = _clock(ids.device) - began - out.prefill_s
    return out


def greedy_generate(
    target: nn.Module,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """The tokens of :func:`greedy_decode`."""
    return greedy_decode(target, prompt_ids, max_new_tokens, stop_token_ids).tokens


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    proposer: Proposer,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    block_size: int,
    stop_token_ids: Sequence[int] = (),
) -> GenerateOutput:
    """Greedy speculative decoding, batch size 1; ``tokens`` equal :func:`greedy_generate`."""
    _check_budget(max_new_tokens)
    out = GenerateOutput()
    if max_new_tokens == 0:
        return out
    ids = _prompt(prompt_ids, target.device)
    device, hidden = ids.device, proposer.uses_features
    history = ids[0].tolist()
    start = ids.shape[1]  # position of the newest token, committed but not yet seen by the target
    cache = DynamicCache(config=target.config)
    past = kv(target, cache)
    began = _clock(device)
    prefill = target(
        input_ids=ids,
        position_ids=torch.arange(start, device=device)[None],
        **past,
        output_hidden_states=hidden,
        logits_to_keep=1,
    )
    out.tokens.append(int(prefill.logits[0, -1].argmax()))
    history.append(out.tokens[-1])
    proposer.start(prefill.hidden_states if hidden else None, start)
    decode_began = _clock(device)
    out.prefill_s = decode_began - began

    while len(out.tokens) < max_new_tokens and out.tokens[-1] not in stop_token_ids:
        size = min(block_size, max_new_tokens - len(out.tokens))  # never commit past the budget
        # The whole block is verified even where the budget cuts it, so ``agreed`` is counted
        # over the same block z-lab's decoder verifies; only ``size`` tokens can be committed.
        drafts = proposer.propose(history, start)[: block_size - 1]
        block = torch.tensor([history[-1:] + drafts], device=device)
        verify = target(
            input_ids=block,
            position_ids=torch.arange(start, start + block.shape[1], device=device)[None],
            **past,
            output_hidden_states=hidden,
        )
        greedy = verify.logits[0].argmax(dim=-1)
        agree = int((block[0, 1:] == greedy[:-1]).long().cumprod(dim=0).sum())
        new = greedy[: min(agree + 1, size)].tolist()
        stop = next((i for i, token in enumerate(new) if token in stop_token_ids), len(new) - 1)
        new = new[: stop + 1]  # a stop among the accepted drafts cuts the block short

        out.tokens.extend(new)
        history.extend(new)
        out.accepted.append(len(new))
        out.agreed.append(agree + 1)
        out.full.append(size == block_size and len(drafts) == size - 1 and stop == agree)
        # block[:len(new)] are now known-good inputs the target has seen
        proposer.commit(verify.hidden_states if hidden else None, start, len(new))
        start += len(new)
        _crop(cache, start)
    out.decode_s = _clock(device) - decode_began
    return out


def dflash_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> GenerateOutput:
    """Speculative decoding with a DFlash drafter proposing whole blocks."""
    return speculative_generate(
        target,
        DrafterProposer(drafter),
        prompt_ids,
        max_new_tokens,
        drafter.config.block_size,
        stop_token_ids,
    )
