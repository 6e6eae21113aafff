"""Simulated acceptance length: τ of the drafter during training, cheap enough to log often.

Per block, τ is 1 + the number of leading slots whose draft equals the target's own token
there (the drafter's top-1, or for a drafter with a selector, its greedy walk from the anchor),
averaged over blocks (SpecForge's ``simulated_acc_len``). The batch is made once: the target's
own greedy continuations of a few held-out prompts, one block anchored at every
response token, with the target's features. So a match is what verification would accept, and
each measurement costs one drafter forward and its LM head; the result depends on the weights
only. It differs from ``evaluate``'s τ, which counts only the blocks decoding really reaches.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.data.chat import template_renderer
from dflash.data.conversations import read_conversations
from dflash.data.tokenizer import stop_token_ids
from dflash.features.target_forward import target_features
from dflash.metrics.names import SELECTOR, plotted
from dflash.model.dflash2 import teacher_predecessors
from dflash.model.drafter_attention import build_attention_mask
from dflash.model.generate import greedy_generate
from dflash.model.labels import block_labels
from dflash.model.objective import LOGITS_PER_CHUNK, Objective
from dflash.model.position_weights import position_weight

PROMPTS = 8
"""Held-out conversations in the batch: the first ones by id, cut before their first answer."""
NEW_TOKENS = 32
"""Greedy tokens the target writes after each prompt; every one anchors a block."""
HEAD_CHUNK = 4096
"""Block slots sent through the LM head at once: bounds the logits at a large vocabulary."""
ROW_FIGURES = ("simulated_tau", *plotted(SELECTOR))
"""What a log row measures on the held-out batch (a selector's figures with a selector only);
a validation measures each as ``val_<name>``."""


def heldout_prompts(path: Path, tokenizer, budget: int, options: dict) -> list[list[int]]:
    """The first ``PROMPTS`` held-out conversations (by id) up to their first assistant turn,
    rendered as training data is: with their tools and ``data.chat_template_kwargs``."""
    render = template_renderer(tokenizer, options)
    prompts = []
    for conv in sorted(read_conversations(path), key=lambda c: c["conversation_id"]):
        roles = [m["role"] for m in conv["messages"]]
        if "assistant" not in roles or len(prompts) == PROMPTS:
            continue
        text = render(conv["messages"][: roles.index("assistant")], True, conv.get("tools"))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(list(ids)[-budget:])
    return prompts


def through_first_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token: what a stopping decode returns."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
    return tokens[:end]


def answer(target: nn.Module, prompt: list[int], stops: set[int]) -> list[int]:
    """The target's greedy answer to ``prompt``, ``NEW_TOKENS`` forwards on every rank.

    A sharded target gathers its layers in every forward, so each rank must run the same
    number of them: decoding runs the whole budget and is cut at the first stop afterwards,
    rather than stopping on a token that one rank might see and another not.
    """
    return through_first_stop(greedy_generate(target, prompt, NEW_TOKENS), stops)


def pack(prompts: list[list[int]], answers: list[list[int]], device) -> dict[str, Tensor]:
    """One row of documents ``prompt + answer``; the loss mask covers the answers."""
    ids, docs, positions, answer = [], [], [], []
    for doc, (prompt, new) in enumerate(zip(prompts, answers, strict=True)):
        ids += prompt + new
        docs += [doc] * (len(prompt) + len(new))
        positions += range(len(prompt) + len(new))
        answer += [0] * len(prompt) + [1] * len(new)
    row = {"input_ids": ids, "document_ids": docs, "position_ids": positions, "loss_mask": answer}
    return {k: torch.tensor([v], device=device) for k, v in row.items()}


def heldout_row(
    heldout: Path,
    target: nn.Module,
    tokenizer,
    layer_ids: list[int],
    max_seq_len: int,
    autocast,
    options: dict,
) -> dict[str, Tensor] | None:
    """The target's part of the batch: the packed row and its features (None without
    held-out prompts). A decoupled target rank makes it and sends it to the drafter ranks."""
    prompts = heldout_prompts(heldout, tokenizer, max_seq_len - NEW_TOKENS, options)
    if not prompts:
        return None
    device = target.get_input_embeddings().weight.device
    stops = set(stop_token_ids(tokenizer))
    answers = [answer(target, p, stops) for p in prompts]
    row = pack(prompts, answers, device)
    ids, docs, pos = row["input_ids"], row["document_ids"], row["position_ids"]
    with torch.no_grad(), autocast:
        row["features"] = target_features(target, ids, pos, docs, layer_ids)
    return row


def label_log_probs(logits: Tensor, labels: Tensor) -> Tensor:
    """``[N]`` fp32 log-probabilities of ``labels`` under ``logits`` ``[N, V]``, a few rows at
    a time: an fp32 copy of a whole ``HEAD_CHUNK`` of a large vocabulary would take GBs."""
    rows = max(1, LOGITS_PER_CHUNK // logits.shape[-1])
    out = []
    for part, y in zip(logits.split(rows), labels.split(rows), strict=True):
        part = part.float()
        out.append(part.gather(-1, y[:, None])[:, 0] - part.logsumexp(-1))
    return torch.cat(out)


@dataclass
class SimulatedTau:
    """The fixed batch, ready for the drafter: blocks, their mask, labels and target features."""

    features: Tensor
    context_positions: Tensor
    document_ids: Tensor
    anchors: Tensor
    """``[A]`` row index of each block's anchor."""
    block_ids: Tensor
    block_positions: Tensor
    mask: object
    labels: Tensor
    counts: Tensor
    autocast: contextlib.AbstractContextManager
    seconds: float = 0.0
    """Time spent measuring, for the cost figure."""

    @classmethod
    def build(
        cls,
        heldout: Path,
        target: nn.Module,
        tokenizer,
        drafter,
        max_seq_len: int,
        autocast,
        options: dict,
    ):
        """The batch from the ``heldout`` conversations; None when they hold no prompt to
        continue."""
        layer_ids = drafter.config.target_layer_ids
        row = heldout_row(heldout, target, tokenizer, layer_ids, max_seq_len, autocast, options)
        return cls.from_row(row, drafter, autocast)

    @classmethod
    def from_row(cls, row: dict[str, Tensor] | None, drafter, autocast):
        """The batch from a :func:`heldout_row`, made on this rank or sent by a target rank."""
        if row is None:
            return None
        ids, docs, pos = row["input_ids"], row["document_ids"], row["position_ids"]
        device, c = ids.device, drafter.config
        following = torch.cat([docs[:, 1:] == docs[:, :-1], docs.new_zeros(1, 1).bool()], dim=1)
        anchors = torch.nonzero((row["loss_mask"] == 1) & following)[:, 1][None]
        slot = torch.arange(c.block_size, device=device)
        block_ids = torch.where(slot == 0, ids[0, anchors[0]][:, None], c.mask_token_id)
        labels, counts = block_labels(ids, row["loss_mask"], docs, anchors, c.block_size)
        return cls(
            features=row["features"],
            context_positions=pos,
            document_ids=docs,
            anchors=anchors[0],
            block_ids=block_ids.flatten()[None],
            block_positions=(pos[0, anchors[0]][:, None] + slot).flatten()[None],
            mask=build_attention_mask(anchors, docs, c.block_size, ids.shape[1]),
            labels=labels[0],
            counts=counts[0],
            autocast=autocast,
        )

    @torch.no_grad()
    def _slots(self, drafter, log_probs: bool = False) -> dict[str, Tensor]:
        """``[A, bs]`` per block slot, from one drafter forward: ``top``, its top-1 token;
        ``drafts``, what it proposes (the selector's walk where it has one, else ``top``), and
        with a selector its teacher-forced hits (:meth:`_selector_hits`); with ``log_probs``,
        ``log_probs`` (fp32, of the label)."""
        labels = self.labels.flatten()
        with self.autocast:
            hidden = drafter(
                self.block_ids, self.block_positions, self.features, self.context_positions,
                self.mask,
            )[0]  # fmt: skip
            tops, scores = [], []
            for h, y in zip(hidden.split(HEAD_CHUNK), labels.split(HEAD_CHUNK), strict=True):
                logits = drafter.logits(h)
                tops.append(logits.argmax(-1))
                if log_probs:
                    scores.append(label_log_probs(logits, y))
            shape = self.labels.shape
            out = {"top": torch.cat(tops).view(shape)}
            out["drafts"] = out["top"]
            selector = with_selector(drafter)
            if selector is not None:
                out["drafts"] = self._walk(selector, hidden.view(*shape, -1))
                out |= self._selector_hits(selector, hidden)
        if log_probs:
            out["log_probs"] = torch.cat(scores).view(shape)
        return out

    def _walk(self, drafter, hidden: Tensor) -> Tensor:
        """``[A, bs]``: each block's anchor, then the selector's greedy walk from it; a few
        blocks at a time, so the logits stay ``HEAD_CHUNK`` slots."""
        anchors = self.block_ids.view(self.labels.shape)[:, 0]
        blocks = max(1, HEAD_CHUNK // self.labels.shape[1])
        walked = [
            drafter.walk(h, a).tokens
            for h, a in zip(hidden.split(blocks), anchors.split(blocks), strict=True)
        ]
        return torch.cat([anchors[:, None], torch.cat(walked)], dim=1)

    def _selector_hits(self, drafter, hidden: Tensor) -> dict[str, Tensor]:
        """``[A, bs]`` per slot: ``in_top_k``, the label among the head's K; ``selected``, the
        selector's best given the label's own predecessor is the label (teacher-forced);
        ``selector_ce``, the K-way cross-entropy of the label training minimises there."""
        block_size = self.labels.shape[1]
        predecessors = teacher_predecessors(self.labels.flatten(), block_size)  # slot 0: anchor
        scores = drafter.selector_scores(hidden, predecessors, self.labels.flatten(), HEAD_CHUNK)
        selected = scores.loss_candidates.gather(-1, scores.scores.argmax(-1, keepdim=True))[:, 0]
        shape = self.labels.shape
        return {
            "in_top_k": scores.gold_in_top_k.view(shape),
            "selected": selected.view(shape) == self.labels,
            "selector_ce": F.cross_entropy(
                scores.scores.double(), scores.gold_index, reduction="none"
            ).view(shape),
        }

    def _taus(self, top: Tensor) -> Tensor:
        """``[A]``: per block, 1 + the drafts accepted before the first miss."""
        hits = (top == self.labels) & self.counts
        return 1 + hits[:, 1:].long().cumprod(dim=1).sum(dim=1)

    def block_taus(self, drafter) -> Tensor:
        """``[A]``: per block, 1 + the drafts accepted before the first miss."""
        return self._taus(self._slots(drafter)["drafts"])

    def measure(self, drafter) -> float:
        """τ: the mean over blocks, timed for the cost figure."""
        return self.row_figures(drafter)["simulated_tau"]

    def row_figures(self, drafter) -> dict[str, float]:
        """A log row's figures from one drafter forward: ``simulated_tau``, the mean over
        blocks, and a selector's own (:data:`SELECTOR_FIGURES`); timed for the cost figure."""
        began = time.perf_counter()
        slots = self._slots(drafter)
        figures = {"simulated_tau": self._taus(slots["drafts"]).double().mean().item()}
        figures |= self._selector_figures(slots)
        self.seconds += time.perf_counter() - began
        return figures

    def validate(self, drafter, objective: Objective, gamma: float) -> dict[str, float]:
        """Validation figures of one drafter forward over the batch's counted block slots.

        ``val_loss`` is the cross-entropy of the target's token (its own greedy answer, so
        also its argmax) weighted by slot as ``objective.position_weight`` says (decay with
        ``gamma``, or from the drafter's probabilities); CE whatever ``objective.loss`` is, since
        the batch keeps the target's tapped features, not its distribution. A selector's
        K-way cross-entropy joins it as the objective adds it (``objective.selector_alpha``).
        ``val_accuracy`` is the share of counted slots whose top-1 is that token, and
        ``val_simulated_tau`` is :meth:`measure`'s τ. A drafter with a selector adds its
        figures (``val_top_k_recall`` ..., :mod:`dflash.metrics.names`). Timed into the cost
        figure.
        """
        began = time.perf_counter()
        slots = self._slots(drafter, log_probs=True)
        log_probs, counts = slots["log_probs"], self.counts
        weighting = position_weight(objective.position_weight)
        weights = weighting.blocks(log_probs.exp(), counts, objective, gamma).double()
        loss = -(weights * log_probs.double()).sum()
        if "selector_ce" in slots:  # the objective's selector term, weighed as the head's
            ce = slots["selector_ce"].where(weights > 0, 0.0)
            loss = loss + objective.selector_alpha * (weights * ce).sum()
        loss = loss / weights.sum().clamp(min=1e-12)
        figures = {
            "val_loss": loss.item(),
            "val_accuracy": self._share(slots["top"] == self.labels),
            "val_simulated_tau": self._taus(slots["drafts"]).double().mean().item(),
        }
        figures |= {f"val_{k}": v for k, v in self._selector_figures(slots).items()}
        self.seconds += time.perf_counter() - began
        return figures

    def _selector_figures(self, slots: dict[str, Tensor]) -> dict[str, float]:
        """A selector's figures over the counted slots (none without one): the label's share
        among the head's K, teacher-forced and walked, and τ were every slot right whenever the
        K hold the label."""
        if "selected" not in slots:
            return {}
        oracle = self.labels.where(slots["in_top_k"], -1)  # the label wherever the K hold it
        return {
            "top_k_recall": self._share(slots["in_top_k"]),
            "selector_accuracy": self._share(slots["selected"]),
            "path_accuracy": self._share(slots["drafts"] == self.labels),
            "top_k_oracle_tau": self._taus(oracle).double().mean().item(),
        }

    def _share(self, hits: Tensor) -> float:
        """The share of counted slots where ``hits [A, bs]`` holds."""
        return ((hits & self.counts).sum() / self.counts.sum().clamp(min=1)).item()


def with_selector(drafter) -> nn.Module | None:
    """The drafter (DDP's inner module) when it drafts by a selector's walk, else None."""
    inner = getattr(drafter, "module", drafter)
    return inner if hasattr(inner, "walk") else None
