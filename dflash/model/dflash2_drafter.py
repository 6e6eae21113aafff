"""The DFlash 2 drafter as it trains: the DFlash drafter with block-local convs and a selector.

Every layer of :class:`~dflash.model.drafter.DFlashDrafter` becomes a
:class:`~dflash.model.dflash2.DFlash2Layer` under the training attention, and a
:class:`~dflash.model.dflash2.CandidateSelector` sits on the target head's top-K. The forward
is DFlash's, so every row layout the training rule handles holds here too: blocks lie end to
end, ``bs`` slots each, so slot ``q % bs`` of the query axis is a slot's index from its anchor
and the conv's taps stop at every block start. A block never spans two anchors or two
documents, and a padded block reaches no other. A fresh DFlash 2 drafter computes what a DFlash
one of the same weights does: convs the identity, pair term 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.model import hf_files
from dflash.model.dflash2 import (
    CandidateSelector,
    DFlash2Layer,
    SelectorScores,
    Walk,
    draft_value,
    init_dflash2_,
    teacher_predecessors,
)
from dflash.model.dflash2_weights import export_weights
from dflash.model.drafter import DFlashDrafter, TrainingAttention
from dflash.model.objective import chunk_rows
from dflash.model.shipped import DFlashDraftConfig

ARCHITECTURE = "DFlash2DraftModel"
"""``architectures[0]`` of a DFlash 2 export: the class vLLM and SGLang serve it by."""


@dataclass(frozen=True)
class DFlash2Sizes:
    """The four ``dflash_config`` fields that make a drafter DFlash 2, under their served names."""

    conv_kernel_size: int
    """Taps of each conv: slot t mixes with slots t-1 .. t-taps+1 of its block."""
    conv_group_size: int
    """Contiguous channels sharing one content-dependent kernel value; divides the hidden size."""
    selector_rank: int
    """Rank r of the selector's two codebooks over the vocabulary."""
    selector_top_k: int
    """Candidates K per slot: the head's top-K, rescored by the selector."""


def dflash2_config(config: DFlashDraftConfig, sizes: DFlash2Sizes) -> DFlashDraftConfig:
    """A copy of a DFlash drafter's config with the DFlash 2 sizes under ``dflash_config``."""
    copy = type(config).from_dict(config.to_dict())
    copy.dflash_config = {**config.dflash, **asdict(sizes)}
    return copy


def is_dflash2(config: DFlashDraftConfig) -> bool:
    """Whether ``config`` names every DFlash 2 size (in ``dflash_config`` or at the top)."""
    return all(
        config.dflash.get(f.name, getattr(config, f.name, None)) is not None
        for f in fields(DFlash2Sizes)
    )


class TrainingDFlash2Layer(DFlash2Layer):
    attention = TrainingAttention


class DFlash2Drafter(DFlashDrafter):
    """DFlash's training drafter with DFlash 2 layers and ``candidate_selector``.

    Its state dict holds DFlash's keys and, beside them, ``layers.{i}.{attention,mlp}_conv.*``
    and ``candidate_selector.*``: the names the engines load (:mod:`dflash.model.dflash2_weights`).
    """

    def __init__(
        self, config: DFlashDraftConfig, embed_tokens: nn.Module, lm_head: nn.Module
    ) -> None:
        super().__init__(config, embed_tokens, lm_head)
        init_dflash2_(self, std=config.initializer_range)

    def build_draft(self, config: DFlashDraftConfig, layer: type | None = None) -> None:
        """DFlash's modules with DFlash 2 layers, whatever layer DFlash asks for, then the
        selector."""
        super().build_draft(config, TrainingDFlash2Layer)
        self.candidate_selector = CandidateSelector.from_config(config)

    @classmethod
    def from_target(
        cls, target: nn.Module, *, sizes: DFlash2Sizes, seed: int = 0, **options
    ) -> DFlash2Drafter:
        """The DFlash drafter ``DFlashDrafter.from_target(target, seed=seed, **options)`` draws,
        made DFlash 2 (:meth:`from_dflash`): a DFlash and a DFlash 2 run of one seed start from
        the same function."""
        dflash = DFlashDrafter.from_target(target, seed=seed, **options)
        config = dflash2_config(dflash.config, sizes)
        return cls.from_dflash(config, dflash.state_dict(), target, seed=seed)

    @classmethod
    def from_dflash(
        cls, config: DFlashDraftConfig, weights: dict[str, Tensor], target: nn.Module, seed: int = 0
    ) -> DFlash2Drafter:
        """The DFlash 2 drafter of ``config`` holding a DFlash drafter's ``weights`` (every
        one of them, no other), convs the identity and the pair term 0, codebooks drawn from
        ``seed``: it computes that drafter's logits and greedy blocks exactly."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls._attach(config, target)
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        added = set(drafter.dflash2_keys())
        wrong = {
            "unexpected": sorted(unexpected),
            "missing": sorted(set(missing) - added),
            "DFlash 2's own (load those with from_weights)": sorted(added - set(missing)),
        }
        if any(wrong.values()):
            named = "; ".join(f"{what} {names}" for what, names in wrong.items() if names)
            raise ValueError(f"not a DFlash drafter's weights: {named}")
        return drafter

    def config_json(self, target_config: Any = None, dtype: torch.dtype | None = None) -> dict:
        """DFlash's ``config.json`` naming :data:`ARCHITECTURE`, with ``block_size`` and the
        four sizes under ``dflash_config`` (where the engines read them first); no
        ``auto_map``, as no remote code ships for DFlash 2."""
        data = super().config_json(target_config, dtype)
        del data["auto_map"]
        served = {"block_size": self.config.block_size, **data["dflash_config"]}
        return data | {"architectures": [ARCHITECTURE], "dflash_config": served}

    def save_pretrained(
        self,
        directory: str | Path,
        target_config: Any = None,
        dtype: torch.dtype | None = None,
        weights: dict[str, Tensor] | None = None,
    ) -> None:
        """DFlash's export with the weights in the engines' layout (checked by
        :func:`~dflash.model.dflash2_weights.export_weights`) and without DFlash's remote
        code, which cannot run these weights."""
        weights = export_weights(self.state_dict() if weights is None else weights, self.config)
        super().save_pretrained(directory, target_config, dtype, weights)
        (Path(directory) / hf_files.REMOTE_CODE).unlink()

    def sizes(self) -> DFlash2Sizes:
        """The four DFlash 2 sizes of its config."""
        return DFlash2Sizes(*(draft_value(self.config, f.name) for f in fields(DFlash2Sizes)))

    def dflash2_keys(self) -> list[str]:
        """The state-dict keys DFlash 2 adds to DFlash's: convs and selector."""
        return [
            name
            for name in self.state_dict()
            if "_conv." in name or name.startswith("candidate_selector.")
        ]

    def unary_transform(self) -> dict:
        """``output_multiplier`` and ``softcap`` of the served unary term U, from the config
        (1 and none unless a checkpoint says otherwise)."""
        dflash = self.config.dflash
        return {
            "output_multiplier": float(dflash.get("output_multiplier", 1.0)),
            "softcap": dflash.get("final_logit_softcapping"),
        }

    def selector_scores(
        self,
        hidden: Tensor,
        predecessors: Tensor,
        gold: Tensor | None = None,
        rows: int | None = None,
    ) -> SelectorScores:
        """Teacher-forced K-way scores of the slots ``hidden [N, H]`` given ``predecessors [N]``
        (:func:`~dflash.model.dflash2.teacher_predecessors` of the blocks' tokens: slot 1's is
        its anchor), ``gold [N]`` entering the scored set only.

        ``rows`` slots at a time: each chunk's ``[rows, V]`` logits go once its top-K is read,
        and the gradient keeps only the K gathered ones, so no ``[N, V]`` tensor is made; the
        pair term then runs once over every slot (:meth:`CandidateSelector.with_pairs`).
        """
        total = max(hidden.shape[0], 1)  # one chunk even when empty, for the result's shapes
        rows = rows or total
        parts = []
        for i in range(0, total, rows):
            part = slice(i, i + rows)
            chunk_gold = None if gold is None else gold[part]
            with torch.no_grad():  # the K picked per slot need no gradient through [rows, V]
                logits = self.logits(hidden[part])
            parts.append(
                self.candidate_selector.unary_scores(
                    logits,
                    chunk_gold,
                    candidate_logits=partial(self.candidate_logits, hidden[part]),
                    **self.unary_transform(),
                )
            )
        unary_only = SelectorScores(
            *(_cat([getattr(p, f) for p in parts]) for f in SelectorScores._fields)
        )
        return self.candidate_selector.with_pairs(unary_only, hidden, predecessors)

    def candidate_logits(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """The head's raw logits of ``ids [N, K]`` alone, from their rows of its weight, with
        the gradient to ``hidden [N, H]``. Recomputed in the backward, so it keeps only
        ``hidden`` and ``ids``: no ``[N, V]`` logits, nor the ``[N, K, H]`` rows."""
        return checkpoint(self._candidate_logits, hidden, ids, use_reentrant=False)

    def _candidate_logits(self, hidden: Tensor, ids: Tensor) -> Tensor:
        weight, bias = self.head()
        out = torch.einsum("nh,nkh->nk", hidden.to(weight.dtype), weight[ids])
        return out if bias is None else out + bias[ids]

    def extra_loss(self, hidden: Tensor, labels: Tensor, plan: Any, objective: Any) -> Tensor:
        """``objective.selector_alpha`` x the selector's K-way cross-entropy of the plan's
        counted labels, each weighed as the head's loss weighs it (``plan.weights``): scores
        teacher-forced on the blocks' own tokens (slot 1's predecessor the anchor), the label
        added to the scored set where the top-K lacks it. ``hidden [1, N * bs, H]`` and
        ``labels [1, N, bs]`` are the objective's; chunked as its head loss is."""
        picked = hidden.flatten(0, 1).index_select(0, plan.index)
        predecessors = teacher_predecessors(labels.flatten(1), self.config.block_size)
        predecessors = predecessors.flatten().index_select(0, plan.index)
        gold = labels.flatten().index_select(0, plan.index)
        weight = self.head()[0]
        scores = self.selector_scores(
            picked, predecessors, gold, rows=chunk_rows(weight.shape[0], weight.device)
        )
        ce = F.cross_entropy(scores.scores, scores.gold_index, reduction="none")
        return objective.selector_alpha * (ce * plan.weights.to(ce.dtype)).sum()

    def walk(
        self,
        hidden: Tensor,
        anchor: Tensor,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Walk:
        """The drafted block: ``hidden [B, Q, H]`` of whole blocks (slot 0 the anchor's, whose
        output drafts nothing), walked from ``anchor [B]`` by the selector."""
        return self.candidate_selector.walk(
            self.logits(hidden[:, 1:]),
            hidden[:, 1:],
            anchor,
            temperature=temperature,
            generator=generator,
            **self.unary_transform(),
        )


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return None if parts[0] is None else torch.cat(parts, dim=0)
