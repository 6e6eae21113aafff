"""Regeneration: replace every assistant turn with the target's own response.

DFlash's drafter learns to predict what the target would say, so it trains on the target's
outputs rather than on the human-written replies. Turn by turn, each assistant message is
regenerated from the conversation so far, in which earlier assistant turns are already the
target's (turns that start past the ``data.max_seq_len`` window are left as written: no
stage downstream ever sees them). Prompts are rendered as the target is served: with the
conversation's ``tools`` and ``data.chat_template_kwargs`` (e.g. ``enable_thinking``). An
answer is stored as the text the target generated, reasoning included, as the assistant
``content``: a thinking target's ``<think>...</think>`` stays inline (those markers are not
special tokens), and the template decides how to show it (Qwen3's splits it into its
reasoning block itself). An answer ends before the first string the tokenizer reads as a
control token (``<|im_end|>``, ``<|im_start|>``, ...), however it was produced: past it, a
fake turn would be learned as the target's. Work is written in shards, each committed by a
small JSON file carrying a fingerprint of everything that decides its content, so an
interrupted run resumes at the first shard missing and never reuses a shard made with other
params, target or data. A shard that lost a conversation to the servers is never
committed, and a run that lost more than ``regenerate.max_failed_fraction`` of them fails
with the previous output left in place.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from dflash.config.schema import Config, RegenerateConfig
from dflash.data.chat import template_renderer
from dflash.data.conversations import (
    read_conversations,
    write_conversations,
)
from dflash.data.specials import special_strings
from dflash.data.tokenizer import stop_token_ids
from dflash.fileio import write_json_atomic

COUNTS = (
    "turns",
    "outside_window",
    "tokens_generated",
    "empty_responses",
    "unterminated",
    "cut_at_stop_string",
)
"""Per-shard counts, summed into the report whether a shard was made now or resumed."""

SHARD = "shard_{index:05d}"
"""A shard's stem: ``.parquet`` holds its conversations, ``.json`` commits it (written last)."""
SHARD_COMMITS = "shard_*.json"

Backend = Callable[[list[dict], int, tqdm], tuple[list[dict], dict]]
"""Regenerates shard ``index``'s rows: returns the rows kept and their counts."""


def generation_config(
    config: RegenerateConfig, stop_ids: list[int], pad_id: int
) -> GenerationConfig:
    """Greedy at temperature 0, else plain sampling (no top-k/top-p: the target's own law)."""
    return GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        do_sample=config.temperature > 0,
        temperature=config.temperature if config.temperature > 0 else None,
        top_k=None,
        top_p=None,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )


def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    pad_id: int,
    stop_ids: list[int],
    generation: GenerationConfig,
) -> list[list[int]]:
    """Continue left-padded prompts together; each answer ends at (and keeps) its first stop."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        generation_config=generation,
    )
    answers = []
    for tokens in output[:, width:].tolist():
        end = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        answers.append(tokens if end is None else tokens[: end + 1])
    return answers


def stop_cutter(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], tuple[str, bool]]:
    """A function giving a text up to the first of the tokenizer's special-token strings
    (end of turn, eos, pad, mask, any added special token), and whether it held one.

    The tokenize stage reads those strings in an answer as control tokens: a written
    ``<|im_end|>`` would end the turn there and what follows would be learned as new turns.
    """
    strings = special_strings(tokenizer)
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def cut(text: str) -> tuple[str, bool]:
        found = pattern.search(text) if pattern else None
        return (text, False) if found is None else (text[: found.start()], True)

    return cut


def answer_turns(messages: list[dict]) -> list[int]:
    """Indices of the assistant turns to regenerate: those that call no tool.

    A tool call stays as written: the tool results after it answer that call, not another.
    """
    return [
        j for j, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")
    ]


def regenerate_shard(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    config: RegenerateConfig,
    max_seq_len: int,
    progress: tqdm,
    template_kwargs: dict | None = None,
) -> tuple[list[dict], dict]:
    """Regenerate the assistant turns of ``rows``, round by round across conversations.

    Round ``r`` answers the ``r``-th assistant turn of every conversation that has one, so
    each prompt already holds the target's earlier answers; prompts keep their last
    ``max_seq_len - max_new_tokens`` tokens. A turn whose prompt alone fills ``max_seq_len``
    starts beyond the window the tokenize stage keeps, so it and the turns after it could
    never be trained on: they stay as written and are counted as ``outside_window``.
    Within a round, prompts are batched in order of length to keep left padding small.
    """
    render = template_renderer(tokenizer, template_kwargs)
    budget = max_seq_len - config.max_new_tokens
    stop_ids = stop_token_ids(tokenizer)
    cut = stop_cutter(tokenizer)
    generation = generation_config(config, stop_ids, tokenizer.pad_token_id)
    rows = [{**row, "messages": [dict(m) for m in row["messages"]]} for row in rows]
    turns = [answer_turns(r["messages"]) for r in rows]
    stats = dict.fromkeys(COUNTS, 0)
    for r in range(max((len(t) for t in turns), default=0)):
        slots = [(i, t[r]) for i, t in enumerate(turns) if len(t) > r]
        if not slots:
            break
        texts = [
            render(rows[i]["messages"][:j], add_generation_prompt=True, tools=rows[i].get("tools"))
            for i, j in slots
        ]
        prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for k in [k for k, p in enumerate(prompts) if len(p) >= max_seq_len]:
            i = slots[k][0]
            stats["outside_window"] += len(turns[i]) - r
            progress.update(len(turns[i]) - r)
            turns[i] = turns[i][:r]
        inside = [k for k, p in enumerate(prompts) if len(p) < max_seq_len]
        inside.sort(key=lambda k: len(prompts[k]))
        for start in range(0, len(inside), config.batch_size):
            batch = inside[start : start + config.batch_size]
            answers = generate(
                model,
                [prompts[k][-budget:] for k in batch],
                tokenizer.pad_token_id,
                stop_ids,
                generation,
            )
            for k, answer in zip(batch, answers, strict=True):
                i, j = slots[k]
                ended = bool(answer) and answer[-1] in stop_ids
                text = tokenizer.decode(answer[:-1] if ended else answer, skip_special_tokens=False)
                content, stopped = cut(text)
                rows[i]["messages"][j] = {"role": "assistant", "content": content}
                stats["turns"] += 1
                stats["tokens_generated"] += len(answer)
                stats["empty_responses"] += not content.strip()
                stats["cut_at_stop_string"] += stopped
                stats["unterminated"] += not ended and not stopped
            progress.update(len(batch))
    return rows, stats


def shard_paths(shards: Path, index: int) -> tuple[Path, Path]:
    """The shard's conversations and its commit file (written last, so it marks completion)."""
    return (
        shards / (SHARD.format(index=index) + ".parquet"),
        shards / (SHARD.format(index=index) + ".json"),
    )


def completed_shard(shards: Path, index: int, fp: str) -> dict | None:
    """The stats of shard ``index`` if it was finished with fingerprint ``fp``, else None."""
    data, commit = shard_paths(shards, index)
    if not (data.exists() and commit.exists()):
        return None
    stats = json.loads(commit.read_text())
    return stats if stats.get("fingerprint") == fp else None


def remove_stale_shards(shards: Path, fp: str) -> None:
    """Delete shards committed under another fingerprint, so outputs never mix runs."""
    for commit in shards.glob(SHARD_COMMITS):
        if json.loads(commit.read_text()).get("fingerprint") != fp:
            commit.unlink()
            commit.with_suffix(".parquet").unlink(missing_ok=True)


def served(
    config: Config, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict
) -> tuple[Backend, dict]:
    """The serving engines at ``regenerate.endpoints``, health-checked now; the engine is the
    served model's identity. Prompts are measured here with the pipeline's tokenizer, so the
    ``data.max_seq_len`` window rule is the in-process one."""
    from dflash.data import serving

    identity = serving.served_model(list(config.regenerate.endpoints), config.regenerate.model)
    render = template_renderer(tokenizer, chat_template_kwargs)
    cut = stop_cutter(tokenizer)

    def prompt_length(messages: list[dict], tools: list | None) -> int:
        text = render(messages, add_generation_prompt=True, tools=tools)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer(rows: list[dict], index: int, progress: tqdm) -> tuple[list[dict], dict]:
        kept, counts = serving.regenerate_shard(
            rows,
            [answer_turns(row["messages"]) for row in rows],
            prompt_length,
            cut,
            config.regenerate,
            serving.Request(
                identity["model"],
                config.regenerate.max_new_tokens,
                config.regenerate.temperature,
                config.regenerate.max_retries,
                config.regenerate.timeout_s,
                chat_template_kwargs,
            ),
            config.data.max_seq_len,
            index,
            progress,
        )
        return kept, dict.fromkeys(COUNTS, 0) | counts

    return answer, {"served": identity}


def shard_of(
    shards: Path, index: int, rows: list[dict], fp: str, answer: Backend, progress: tqdm
) -> tuple[list[dict], dict, bool]:
    """Shard ``index`` in ``shards``: read back if committed under ``fp``, else regenerated and
    committed.

    Returns its conversations, its stats and whether it was made now. A shard that lost a
    conversation to a server failure is not committed: a rerun makes it again. Shards of
    another fingerprint are removed before the first commit, so a run that commits nothing
    leaves them.
    """
    data, commit = shard_paths(shards, index)
    stats = completed_shard(shards, index, fp)
    if stats is not None:
        progress.update(stats["turns"] + stats["outside_window"])
        return read_conversations(data), stats, False
    began = time.perf_counter()
    shard, stats = answer(rows, index, progress)
    stats |= {"fingerprint": fp, "conversations": len(shard)}
    stats["seconds"] = time.perf_counter() - began
    if not stats.get("failed"):
        remove_stale_shards(shards, fp)
        write_conversations(shard, data)
        write_json_atomic(commit, stats)
    return shard, stats, True
