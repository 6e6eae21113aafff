"""Is a speculative output that differs from greedy a bug or a near-tie?

Greedy speculative decoding reproduces the target's greedy output exactly in exact arithmetic.
In bf16 on a GPU, a 1-token forward and a 16-token forward may round differently, and where the
top two logits are nearly equal their argmax can flip. The logit margin at the first divergence
tells the two apart: a near-tie is numerics, a clear margin is a real mismatch.

Two things keep bf16 from passing rounding off as mismatches. The margin is computed in fp32
from the last hidden state, since bf16 logits are 0.06-0.125 apart at typical magnitudes and
would round any smaller margin up to a whole step. And the tolerance grows with the logits'
size in the target's dtype: a bf16 forward's logits move by about one rounding step of their
own magnitude between a cached 1-token pass and a block pass, more than any fixed margin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUNDING_STEPS = 2.0
"""Relative slack, in ``finfo(dtype).eps`` of the larger logit, for the forwards' rounding.

bf16 divergences of tiny targets scaled to real logit sizes (10-50) showed margins up to 1.1
eps of the logit; in fp32 the slack is below 1e-5 and the fixed margin decides alone."""


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@torch.no_grad()
def fp32_logits(target: nn.Module, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens)]`` next-token logits after ``ids``, from the last hidden state in fp32.

    An fp32 head computes them as the target does; of a lower-precision head only the rows of
    ``tokens`` are upcast, so a 150K-token bf16 head is never copied whole.
    """
    ids_t = torch.tensor([ids], device=target.device)
    hidden = target.get_decoder()(input_ids=ids_t).last_hidden_state[:, -1:].float()
    head = target.get_output_embeddings()
    rows = torch.tensor(tokens, device=hidden.device)
    if head.weight.dtype == torch.float32:
        return head(hidden)[0, -1, rows]
    bias = None if head.bias is None else head.bias[rows].float()
    return F.linear(hidden, head.weight[rows].float(), bias)[0, -1]


def rounding_slack(target: nn.Module, logits: torch.Tensor) -> float:
    """How far the target's own rounding can move a logit gap of these logits."""
    eps = torch.finfo(target.get_output_embeddings().weight.dtype).eps
    return ROUNDING_STEPS * eps * float(logits.abs().max())


def classify(
    target: nn.Module,
    prompt: list[int],
    reference: list[int],
    speculative: list[int],
    near_tie: float,
) -> tuple[str, float | None]:
    """``("same" | "near_tie" | "mismatch", margin)`` of a speculative output vs greedy.

    The margin ``logit[greedy] - logit[speculative]`` is measured on the greedy path at the
    first divergence; at most ``near_tie`` plus the target dtype's rounding slack apart, the two
    tokens are within rounding of each other.
    """
    at = first_divergence(reference, speculative)
    if at is None:
        return "same", None
    if at >= min(len(reference), len(speculative)):
        return "mismatch", None  # one stopped where the other went on: not an argmax flip
    logits = fp32_logits(target, prompt + reference[:at], [reference[at], speculative[at]])
    margin = float(logits[0] - logits[1])
    tolerance = near_tie + rounding_slack(target, logits)
    return ("near_tie" if margin <= tolerance else "mismatch"), margin
