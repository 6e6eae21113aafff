"""The DFlash 2 model parts: block-local dynamic convolutions and the candidate selector.

DFlash 2 keeps DFlash's drafter (KV injection, one parallel pass per block) and adds two things.
Each layer wraps its attention and its MLP in a grouped dynamic causal convolution that mixes a
block slot with the slots just before it *inside its own block*, so parallel slots learn what
their neighbours hold. After the pass, a low-rank selector rescores the drafter's top-K tokens
per slot given the token chosen one slot earlier, and the block is read off by a greedy walk from
the anchor. Parameter names and layouts are the ones vLLM, SGLang and z-lab's reference load
(``layers.{i}.attention_conv.base_kernel`` ...), so an exported checkpoint serves unchanged.

Like :mod:`dflash.model.shipped`, this module imports torch and the standard library only (and
that module), so it can ship beside it as remote code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.model.shipped import DFlashDraftConfig, Layer

SIDES = 2
"""A conv's two kernels, ``base_kernel[side]``: 0 convolves the sublayer's input (``prepare``),
1 its output (``finish``); both dynamic parts come from the one projection of the input."""


def draft_value(config: DFlashDraftConfig, name: str) -> int:
    """A DFlash 2 size from ``dflash_config``, else from the top level: the order every engine
    reads it in. There is no default: a checkpoint without it is no DFlash 2 drafter."""
    value = config.dflash.get(name, getattr(config, name, None))
    if value is None:
        raise ValueError(f"the drafter config has no {name} (dflash_config.{name})")
    return int(value)


def block_convolve(
    x: Tensor, dynamic: Tensor, base: Tensor, block_size: int, group_size: int
) -> Tensor:
    """``y_t = sum_j (base[j] + dynamic_t[j]) * x_{t-j}`` with taps cut at each block's start.

    ``x [..., Q, H]`` holds blocks of ``block_size`` slots back to back (a last, shorter block is
    allowed); slot 0 of every block is its anchor and sees nothing earlier. ``dynamic [..., Q,
    taps, H / group_size]`` is one kernel value per group of ``group_size`` contiguous channels,
    added to ``base [taps, H]`` with no activation. Computed in at least fp32 (as vLLM's kernel
    accumulates) and returned in ``x``'s dtype.

    Under autograd only the inputs are kept, and backward recomputes the taps: kept, each
    tap's shifted input and kernel are two fp32 copies of ``x`` per tap, on an 8B target the
    largest activation of the step (``bench/memory_model.py``). The recompute repeats the same
    operations, so the gradients are the same bit for bit.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, dynamic, base)):
        return checkpoint(
            _convolve, x, dynamic, base, block_size, group_size,
            use_reentrant=False, preserve_rng_state=False,
        )  # fmt: skip
    return _convolve(x, dynamic, base, block_size, group_size)


def _convolve(x: Tensor, dynamic: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    taps, hidden = base.shape
    queries = x.shape[-2]
    dtype = torch.promote_types(torch.promote_types(x.dtype, dynamic.dtype), torch.float32)
    groups = (*x.shape[:-1], hidden // group_size, group_size)
    values = x.to(dtype)
    slot = torch.arange(queries, device=x.device) % block_size
    out = torch.zeros(groups, dtype=dtype, device=x.device)
    for j in range(taps):
        earlier = F.pad(values, (0, 0, j, 0))[..., :queries, :] if j else values
        earlier = (earlier * (slot >= j)[:, None].to(dtype)).view(groups)
        kernel = base[j].to(dtype).view(groups[-2:]) + dynamic[..., j, :, None].to(dtype)
        out = out + kernel * earlier
    return out.view(x.shape).to(x.dtype)


class GroupedDynamicCausalConv(nn.Module):
    """The conv around one sublayer: ``prepare`` on its input, ``finish`` on its output.

    ``base_kernel [2, taps, H]`` is ``[side, tap, channel]``; ``kernel_projection`` maps the
    sublayer input ``u_t`` to ``[2, taps, H / group_size]`` (flat index ``side*taps*G + tap*G +
    g``), the content-dependent part of both sides' kernels at slot t.
    """

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} does not divide hidden {hidden_size}")
        if not 1 <= kernel_size <= block_size:
            raise ValueError(f"conv_kernel_size {kernel_size} is not in [1, {block_size}]")
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(SIDES, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, SIDES * kernel_size * self.groups, bias=False
        )
        self.identity_()

    @torch.no_grad()
    def identity_(self) -> None:
        """Both sides the exact identity (tap 0 = 1, the rest and the projection 0), so a fresh
        DFlash 2 layer computes what a DFlash layer does; z-lab's reference leaves these
        uninitialised (load-only code), speculators' trainer starts from the same identity."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """The convolved input and the output side's dynamic kernel, both from ``u [..., Q, H]``."""
        dynamic = self.kernel_projection(u).view(
            *u.shape[:-1], SIDES, self.kernel_size, self.groups
        )
        v = block_convolve(u, dynamic[..., 0, :, :], self.base_kernel[0], *self._sizes())
        return v, dynamic[..., 1, :, :]

    def finish(self, w: Tensor, dynamic: Tensor) -> Tensor:
        """The sublayer output convolved with the kernel ``prepare`` made from its input."""
        return block_convolve(w, dynamic, self.base_kernel[1], *self._sizes())

    def _sizes(self) -> tuple[int, int]:
        return self.block_size, self.group_size


class DFlash2Layer(Layer):
    """The pre-norm layer with a conv after each norm and on each sublayer's output, before the
    residual add; the residual stream itself is never convolved. Block size and conv sizes come
    from the config (``block_size`` overrides: the conv's block is the served width)."""

    def __init__(
        self, config: DFlashDraftConfig, layer: int, block_size: int | None = None
    ) -> None:
        super().__init__(config, layer)
        sizes = (
            config.block_size if block_size is None else block_size,
            draft_value(config, "conv_kernel_size"),
            draft_value(config, "conv_group_size"),
        )
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, *sizes)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, *sizes)

    def forward(self, x: Tensor, *attention_inputs) -> Tensor:
        v, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(v, *attention_inputs), dynamic)
        v, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(v), dynamic)


def unary(logits: Tensor, output_multiplier: float, softcap: float | None) -> Tensor:
    """``U = softcap * tanh(m * z / softcap)`` (``m * z`` without a positive softcap): the served
    transform of the target head's raw logits ``z``; multiplier first, as the selector does."""
    scaled = logits * output_multiplier
    if softcap is not None and softcap > 0:
        scaled = softcap * torch.tanh(scaled / softcap)
    return scaled


class SelectorScores(NamedTuple):
    """Teacher-forced selector scores of every slot (leading dims those of the input)."""

    candidates: Tensor
    """``[..., K]`` the served candidates: top-K of U, best first."""
    loss_candidates: Tensor
    """``[..., K]`` the candidates scored: ``candidates`` with the gold token put at rank K
    (replacing the weakest) where it is missing."""
    scores: Tensor
    """``[..., K]`` ``S(predecessor, loss_candidates)``, with gradient."""
    gold_index: Tensor | None
    """``[...]`` the gold token's index in ``loss_candidates`` (None without gold)."""
    gold_in_top_k: Tensor | None
    """``[...]`` bool: the gold token is one of the served candidates."""


class Walk(NamedTuple):
    """A block read off by the selector, slot by slot from the anchor."""

    tokens: Tensor
    """``[B, n]`` the drafted tokens."""
    candidates: Tensor
    """``[B, n, K]`` each slot's top-K of U, best first."""
    scores: Tensor
    """``[B, n, K]`` ``S_t(x_{t-1}, .)``, given the token drafted before; before temperature."""
    q: Tensor
    """``[B, n, K]`` the draft distribution over the candidates: ``softmax(scores / T)``, one-hot
    at T = 0 (the draft is then deterministic); zero outside the K."""


class CandidateSelector(nn.Module):
    """``S_t(a, b) = U_t(b) + <A(a) * P(h_t), B(b)>`` over the top-K ``b`` of ``U_t``.

    ``A = predecessor_codebook [V, r]`` and ``B = successor_codebook [V, r]`` are bare parameters
    (the checkpoint keys have no ``.weight``); ``P = hidden_projection`` ``[r, H]``, no bias.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k {top_k} is not in [1, {vocab_size}]")
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters(std=0.02)

    @classmethod
    def from_config(cls, config: DFlashDraftConfig) -> CandidateSelector:
        rank, top_k = draft_value(config, "selector_rank"), draft_value(config, "selector_top_k")
        return cls(config.vocab_size, config.hidden_size, rank, top_k)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Codebooks ``normal(0, std)``, ``hidden_projection`` 0: the pair term is exactly 0, so a
        fresh selector walks the unary argmax path, and its first gradient reaches the
        projection. speculators draws all three ``normal(0, 0.02)`` (a small nonzero pair term);
        z-lab's reference does not initialise them."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.successor_codebook, std=std)
        self.hidden_projection.weight.zero_()

    def project(self, hidden: Tensor) -> Tensor:
        """``P(h)`` ``[..., r]`` of the drafter's final (normed) hidden states."""
        return self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))

    def pair(self, projected: Tensor, predecessors: Tensor, candidates: Tensor) -> Tensor:
        """``<A(a) * P(h), B(b)>`` ``[..., K]``: ``a = predecessors [...]``, ``b = candidates``."""
        context = self.predecessor_codebook[predecessors] * projected
        return torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidates])

    def candidates(
        self, logits: Tensor, output_multiplier: float, softcap: float | None
    ) -> tuple[Tensor, Tensor]:
        """U's top-K values and ids, best first, in at least fp32. The transform is increasing,
        so the top-K of the raw logits is taken and only those K are transformed."""
        raw, ids = logits.topk(self.top_k, dim=-1)
        return unary(_scores_dtype(raw), output_multiplier, softcap), ids

    def scores(
        self,
        logits: Tensor,
        hidden: Tensor,
        predecessors: Tensor,
        gold: Tensor | None = None,
        *,
        output_multiplier: float = 1.0,
        softcap: float | None = None,
    ) -> SelectorScores:
        """Teacher-forced K-way scores: ``logits [..., V]`` (raw, the target head's), ``hidden
        [..., H]`` and ``predecessors [...]`` per slot (:func:`teacher_predecessors`): the
        :meth:`unary_scores` plus the pair term (:meth:`with_pairs`)."""
        unary_only = self.unary_scores(
            logits, gold, output_multiplier=output_multiplier, softcap=softcap
        )
        return self.with_pairs(unary_only, hidden, predecessors)

    def unary_scores(
        self,
        logits: Tensor,
        gold: Tensor | None = None,
        *,
        candidate_logits: Callable[[Tensor], Tensor] | None = None,
        output_multiplier: float = 1.0,
        softcap: float | None = None,
    ) -> SelectorScores:
        """The candidates of ``logits [..., V]`` and their U alone as ``scores``.

        ``gold [...]`` (token ids) enters the *scored* set at rank K where the served top-K
        lacks it, as speculators trains, so every slot has a K-way label; the served set is
        returned untouched. U keeps its gradient, so the selector loss also trains the drafter:
        gathered from ``logits``, or ``candidate_logits(ids)`` where given (a gather keeps the
        whole ``[..., V]`` for its backward; then ``logits`` needs no gradient).
        """
        _, served = logits.topk(self.top_k, dim=-1)
        scored, index, present = served, None, None
        if gold is not None:
            scored, index, present = inject_gold(served, gold)
        raw = logits.gather(-1, scored) if candidate_logits is None else candidate_logits(scored)
        u = unary(_scores_dtype(raw), output_multiplier, softcap)
        return SelectorScores(served, scored, u, index, present)

    def with_pairs(
        self, unary_only: SelectorScores, hidden: Tensor, predecessors: Tensor
    ) -> SelectorScores:
        """:meth:`unary_scores` plus ``<A(a) * P(h), B(b)>`` of its scored candidates. Over all
        slots at once, however the unary part was chunked: each codebook lookup's gradient is a
        dense ``[V, r]``, one per call, so a call per chunk would hold one per chunk."""
        u = unary_only.scores
        pair = self.pair(self.project(hidden), predecessors, unary_only.loss_candidates)
        return unary_only._replace(scores=u + pair.to(u.dtype))

    def walk(
        self,
        logits: Tensor,
        hidden: Tensor,
        anchor: Tensor,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        output_multiplier: float = 1.0,
        softcap: float | None = None,
    ) -> Walk:
        """Draft the prediction slots 1.. of blocks: ``logits [B, n, V]`` and ``hidden [B, n,
        H]`` are theirs (not the anchor slot's), ``anchor [B]`` the predecessor of the first.

        Greedy, one slot after another, each given the token drafted just before: argmax of S at
        T = 0, else a draw from ``softmax(S / T)`` over the K (``generator`` makes it
        repeatable). No path search: the engines walk exactly so.
        """
        if temperature < 0:
            raise ValueError(f"temperature {temperature} is negative")
        u, candidates = self.candidates(logits, output_multiplier, softcap)
        projected = self.project(hidden)
        previous, tokens, rows, qs = anchor, [], [], []
        for t in range(candidates.shape[1]):
            s = u[:, t] + self.pair(projected[:, t], previous, candidates[:, t]).to(u.dtype)
            if temperature > 0:
                q = torch.softmax(s / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
            else:
                index = s.argmax(dim=-1)
                q = F.one_hot(index, self.top_k).to(s.dtype)
            previous = candidates[:, t].gather(-1, index[:, None])[:, 0]
            tokens.append(previous)
            rows.append(s)
            qs.append(q)
        return Walk(_stack(tokens, candidates[..., 0]), candidates, _stack(rows, u), _stack(qs, u))


def inject_gold(served: Tensor, gold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``served [..., K]`` with ``gold [...]`` at rank K where missing, its index, and whether it
    was there: the loss candidates, never the served ones (a copy)."""
    match = served == gold[..., None]
    present = match.any(dim=-1)
    last = served.shape[-1] - 1
    index = torch.where(present, match.long().argmax(dim=-1), last)
    scored = served.clone()
    scored[..., last] = torch.where(present, served[..., last], gold)
    return scored, index, present


def teacher_predecessors(tokens: Tensor, block_size: int) -> Tensor:
    """Each slot's teacher-forced predecessor ``[..., Q]``: slot t's is token t-1 of its block,
    slot 1's the anchor (slot 0 holds it; slot 0's own, unused, is the anchor too).
    ``tokens [..., Q]`` are blocks of ``block_size`` back to back: anchor, then the labels."""
    slot = torch.arange(tokens.shape[-1], device=tokens.device) % block_size
    earlier = F.pad(tokens, (1, 0))[..., :-1]
    return torch.where(slot == 0, tokens, earlier)


def init_dflash2_(model: nn.Module, std: float) -> None:
    """The DFlash 2 starting point, after a trainer's own init of every ``Linear``: every conv
    the identity, every selector's pair term 0 (codebooks ``normal(0, std)``)."""
    for module in model.modules():
        if isinstance(module, GroupedDynamicCausalConv):
            module.identity_()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(std)


def _scores_dtype(x: Tensor) -> Tensor:
    """At least fp32, as the engines compute U and the scores."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _stack(rows: list[Tensor], empty: Tensor) -> Tensor:
    """Slots stacked along dim 1; ``empty`` (which has none) where there is no slot to walk."""
    return torch.stack(rows, dim=1) if rows else empty
