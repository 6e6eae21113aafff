"""Stage ``evaluate``: acceptance length τ of the trained drafter on held-out prompts.

Each prompt is a held-out conversation cut before one of its assistant turns (chosen with a
seeded generator), rendered with the chat template the target serves. Every prompt is decoded
twice, plainly greedy and speculatively; the two outputs must be identical (DFlash is
lossless), and any prompt where they differ is counted, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dflash import paths
from dflash.config import Config
from dflash.data.conversations import read_conversations
from dflash.data.regenerate import stop_token_ids
from dflash.data.tokenizer import load_tokenizer
from dflash.fileio import remove_files, write_json_atomic, write_text_atomic
from dflash.model.drafter import DFlashDrafter
from dflash.model.generate import dflash_generate, greedy_generate
from dflash.model.target import load_target
from dflash.progress import progress_bar


@dataclass
class PromptResult:
    accepted: list[int]
    mismatch: bool
    n_tokens: int
    greedy_s: float
    dflash_s: float


def select_prompts(conversations: list[dict], tokenizer, config: Config) -> list[list[int]]:
    """Deterministic prompts: for each conversation, the turns before a random assistant turn."""
    rng = np.random.default_rng(config.evaluate.seed)
    budget = config.data.max_seq_len - config.evaluate.max_new_tokens
    prompts = []
    for conv in sorted(conversations, key=lambda c: c["conversation_id"]):
        messages = conv["messages"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            continue
        cut = turns[int(rng.integers(len(turns)))]
        ids = tokenizer.apply_chat_template(
            messages[:cut], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids)[-budget:])
        if len(prompts) == config.evaluate.num_prompts:
            break
    return prompts


def acceptance_by_position(accepted: list[int], block_size: int) -> list[float]:
    """Share of verification steps whose draft slot k (1..bs-1) was accepted."""
    drafted = np.asarray(accepted) - 1  # the target's bonus token is not a draft
    return [float((drafted >= k).mean()) if len(drafted) else 0.0 for k in range(1, block_size)]


def evaluate_prompts(target, drafter, prompts, max_new_tokens, stop_ids) -> list[PromptResult]:
    results = []
    for ids in progress_bar(prompts, desc="evaluate", unit="prompt"):
        t0 = time.perf_counter()
        reference = greedy_generate(target, ids, max_new_tokens, stop_ids)
        t1 = time.perf_counter()
        spec = dflash_generate(target, drafter, ids, max_new_tokens, stop_ids)
        t2 = time.perf_counter()
        results.append(
            PromptResult(
                accepted=list(spec.accepted),
                mismatch=list(spec.tokens) != list(reference),
                n_tokens=len(spec.tokens),
                greedy_s=t1 - t0,
                dflash_s=t2 - t1,
            )
        )
    return results


def summarize(results: list[PromptResult], block_size: int) -> dict:
    accepted = [a for r in results for a in r.accepted]
    tokens = sum(r.n_tokens for r in results)
    greedy_s = sum(r.greedy_s for r in results)
    dflash_s = sum(r.dflash_s for r in results)
    return {
        "acceptance_length": float(np.mean(accepted)) if accepted else 0.0,
        "per_position_acceptance": acceptance_by_position(accepted, block_size),
        "lossless_mismatches": sum(r.mismatch for r in results),
        "n_prompts": len(results),
        "generated_tokens": tokens,
        "target_forwards": len(accepted),
        "greedy_tokens_per_s": tokens / max(greedy_s, 1e-9),
        "dflash_tokens_per_s": tokens / max(dflash_s, 1e-9),
        "speedup": greedy_s / max(dflash_s, 1e-9),
    }


def run(config: Config) -> None:
    torch.manual_seed(config.evaluate.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(paths.TARGET, device=device)
    drafter = DFlashDrafter.from_pretrained(paths.DRAFTER, target).to(device).eval()
    tokenizer = load_tokenizer(paths.TOKENIZER)
    prompts = select_prompts(read_conversations(paths.HELDOUT), tokenizer, config)
    if not prompts:
        raise ValueError(f"{paths.HELDOUT} has no conversation with an assistant turn to evaluate")
    with torch.no_grad():
        results = evaluate_prompts(
            target, drafter, prompts, config.evaluate.max_new_tokens, stop_token_ids(tokenizer)
        )
    metrics = summarize(results, drafter.config.block_size)
    rows = "position,acceptance\n" + "".join(
        f"{k},{a:.6f}\n" for k, a in enumerate(metrics["per_position_acceptance"], start=1)
    )
    # Two files in two directories: the old pair goes first and the metrics come last, so a
    # run killed in between leaves no old metrics beside new acceptance rows.
    remove_files(paths.EVAL_METRICS, paths.EVAL_ACCEPTANCE)
    write_text_atomic(paths.EVAL_ACCEPTANCE, rows)
    write_json_atomic(paths.EVAL_METRICS, metrics, sort_keys=True)
    print(
        f"[evaluate] τ = {metrics['acceptance_length']:.3f} over {metrics['n_prompts']} prompts, "
        f"mismatches {metrics['lossless_mismatches']}, speedup {metrics['speedup']:.2f}x (CPU)"
    )
