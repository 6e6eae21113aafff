"""Is a speculative output that differs from greedy a bug or a near-tie?

Greedy speculative decoding reproduces the target's greedy output exactly in exact arithmetic.
In bf16 on a GPU, a 1-token forward and a 16-token forward may round differently, and where the
top two logits are nearly equal their argmax can flip. The logit margin at the first divergence
tells the two apart: a near-tie is numerics, a clear margin is a real mismatch.
"""

from __future__ import annotations

import torch
from torch import nn


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@torch.no_grad()
def logit_gap(target: nn.Module, prompt: list[int], prefix: list[int], a: int, b: int) -> float:
    """``logit[a] - logit[b]`` of the next token after ``prompt + prefix``, in fp32.

    With ``a`` the greedy token and ``b`` the one the speculative path took, this is the top-2
    margin when the flip is between the two best tokens, and larger otherwise.
    """
    ids = torch.tensor([prompt + prefix], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return float(logits[a] - logits[b])


def classify(
    target: nn.Module,
    prompt: list[int],
    reference: list[int],
    speculative: list[int],
    near_tie: float,
) -> tuple[str, float | None]:
    """``("same" | "near_tie" | "mismatch", margin)`` of a speculative output vs greedy.

    The margin is measured on the greedy path at the first divergence; at most ``near_tie``
    apart, the two tokens are within rounding of each other.
    """
    at = first_divergence(reference, speculative)
    if at is None:
        return "same", None
    if at >= min(len(reference), len(speculative)):
        return "mismatch", None  # one stopped where the other went on: not an argmax flip
    margin = logit_gap(target, prompt, reference[:at], reference[at], speculative[at])
    return ("near_tie" if margin <= near_tie else "mismatch"), margin
