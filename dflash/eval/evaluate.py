"""Scoring a drafter: τ on prompt sets, against two baselines (the evaluate stage runs it).

The held-out split is always scored (its figures are the top-level keys of
``metrics/eval.json``); ``evaluate.sets`` adds the user's prompt sets, each under ``sets``
with the same keys (:mod:`dflash.eval.prompts` says how prompts are made). Every prompt is
decoded plainly greedy and then, through the same verifier, speculatively with the trained
drafter, with n-gram prompt lookup and with the drafter at initialisation (same seed as
training). The speculative outputs must equal greedy (DFlash is lossless); a difference is
counted, as a near-tie when the target's top two logits at the first divergence are within
rounding. Each set is broken down by strata (:mod:`dflash.eval.strata`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.config.schema import Config
from dflash.eval.length_loss import loss_by_tercile, sample_loss
from dflash.eval.loops import ends_in_loop
from dflash.eval.lossless import classify
from dflash.eval.metrics import acceptance_by_position, summarize_method, wall_seconds
from dflash.eval.prompts import PromptSet
from dflash.eval.strata import strata
from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.dflash2_generate import SelectorProposer
from dflash.model.drafter import DFlashDrafter
from dflash.model.generate import (
    DrafterProposer,
    GenerateOutput,
    greedy_decode,
    speculative_generate,
)
from dflash.progress import progress_bar

DECODERS = ("dflash", "ngram", "untrained")
"""What each held-out prompt is decoded with: the drafter, prompt lookup, an untrained drafter."""
NGRAM_MAX = 4
"""Longest suffix n-gram prompt lookup matches (vLLM's ``prompt_lookup_max`` default)."""


@dataclass
class Decodes:
    """Every method's output per prompt, and how each speculative output compares to greedy."""

    greedy: list[GenerateOutput] = field(default_factory=list)
    methods: dict[str, list[GenerateOutput]] = field(
        default_factory=lambda: {m: [] for m in DECODERS}
    )
    verdicts: dict[str, list[str]] = field(default_factory=lambda: {m: [] for m in DECODERS})
    margins: list[float] = field(default_factory=list)
    """Top-2 logit margins at the first divergence of any method (near-ties and mismatches)."""


def untrained_drafter(drafter: DFlashDrafter, target, seed: int) -> DFlashDrafter:
    """The same drafter at initialisation, its attention as the drafter's (windows, causality)
    and its mask token: what training added is the difference."""
    c = drafter.config
    types = list(getattr(c, "layer_types", None) or [])
    sliding = "sliding_attention" in types
    options = {
        "block_size": c.block_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_target_features": len(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "mask_token": c.mask_token,
        "seed": seed,
        "layer_types": types if sliding else None,
        "sliding_window": c.sliding_window if sliding else None,
        "causal": bool(c.dflash.get("causal", False)),
    }
    if isinstance(drafter, DFlash2Drafter):
        sizes = drafter.sizes()
        return DFlash2Drafter.from_target(target, sizes=sizes, **options).eval()
    return DFlashDrafter.from_target(target, **options).eval()


def proposer(drafter: DFlashDrafter) -> DrafterProposer:
    """How decoding drafts with ``drafter``: DFlash 2's greedy selector walk from the anchor,
    else each slot's argmax."""
    if isinstance(drafter, DFlash2Drafter):
        return SelectorProposer(drafter)
    return DrafterProposer(drafter)


def decode_all(target, proposers: dict, prompts, new_tokens, near_tie, stop_ids, bs) -> Decodes:
    out = Decodes()
    for ids in progress_bar(prompts, desc="evaluate", unit="prompt"):
        reference = greedy_decode(target, ids, new_tokens, stop_ids)
        out.greedy.append(reference)
        for name, proposer in proposers.items():
            spec = speculative_generate(target, proposer, ids, new_tokens, bs, stop_ids)
            verdict, margin = classify(target, ids, reference.tokens, spec.tokens, near_tie)
            out.methods[name].append(spec)
            out.verdicts[name].append(verdict)
            if margin is not None:
                out.margins.append(margin)
    return out


def answer_shape(greedy: list[GenerateOutput], max_new_tokens: int, stop_ids) -> dict:
    """Shares of greedy answers that ran to the cap and that end in a repeating tail."""
    n = max(len(greedy), 1)
    capped = sum(len(o.tokens) >= max_new_tokens and o.tokens[-1] not in stop_ids for o in greedy)
    looping = sum(ends_in_loop(o.tokens) for o in greedy)
    return {"answer_cap_fraction": capped / n, "answer_loop_fraction": looping / n}


def summarize(decodes: Decodes, seed: int, block_size: int, new_tokens: int, stop_ids) -> dict:
    runs = {m: summarize_method(decodes.methods[m], decodes.greedy, seed) for m in DECODERS}
    dflash = decodes.methods["dflash"]
    tokens = sum(len(o.tokens) for o in dflash)
    full = sum(f for o in dflash for f in o.full)
    metrics = {
        **runs["dflash"],
        "per_position_acceptance": acceptance_by_position(dflash, block_size),
        "full_block_steps": full,
        "lossless_mismatches": decodes.verdicts["dflash"].count("mismatch"),
        "near_tie_divergences": decodes.verdicts["dflash"].count("near_tie"),
        "divergence_margins": sorted(decodes.margins),
        "n_prompts": len(dflash),
        "generated_tokens": tokens,
        "greedy_tokens_per_s": tokens / max(wall_seconds(decodes.greedy), 1e-9),
        "dflash_tokens_per_s": tokens / max(wall_seconds(dflash), 1e-9),
        "baselines": {
            m: {
                **{k: runs[m][k] for k in ("acceptance_length", "acceptance_length_pooled")},
                "speedup": runs[m]["speedup"],
                "lossless_mismatches": decodes.verdicts[m].count("mismatch"),
            }
            for m in DECODERS[1:]
        },
    }
    return metrics | answer_shape(decodes.greedy, new_tokens, stop_ids)


def score(target, drafter, proposers: dict, prompt_set: PromptSet, config: Config, stop_ids):
    """Every figure of one prompt set, strata included, and its decodes."""
    ev, bs = config.evaluate, drafter.config.block_size
    ids = [p.ids for p in prompt_set.prompts]
    new_tokens = prompt_set.max_new_tokens
    with torch.no_grad():
        decodes = decode_all(target, proposers, ids, new_tokens, ev.near_tie_margin, stop_ids, bs)
        sums = [
            sample_loss(target, drafter, p, o.tokens, config.drafter.gamma)
            for p, o in zip(ids, decodes.greedy, strict=True)
        ]
    metrics = summarize(decodes, ev.seed, bs, new_tokens, stop_ids)
    lengths = [len(p) + len(o.tokens) for p, o in zip(ids, decodes.greedy, strict=True)]
    metrics |= loss_by_tercile(lengths, sums)
    metrics["strata"] = strata(prompt_set.prompts, prompt_set.modes, decodes.methods, bs, ev.seed)
    metrics["modes"] = prompt_set.modes
    metrics["records"] = prompt_set.records
    return metrics, decodes
