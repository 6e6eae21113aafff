"""The prompts ``evaluate`` scores: the held-out split and the user's prompt sets.

A set is a file of conversations under ``data/prompts/`` (OpenAI ``messages`` or ShareGPT, JSONL
or Parquet), read by ingest's own readers: a record that cannot become a conversation is
counted by reason, never dropped unseen. Each conversation gives one prompt, cut before one of
its assistant turns chosen with a seeded generator, as the held-out split always was; a
conversation of a set that ends on a user or tool turn (a benchmark question) is scored at its
end. The prompt is rendered once per mode (the set's template options, e.g. thinking on and
off) and tagged with what the strata split on: its mode, whether it carries tool schemas, tool
calls or tool results, and its length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash.config.schema import HELDOUT_SET, Config, PromptSetConfig
from dflash.data.chat import TEMPLATE_FAILURES, template_renderer
from dflash.data.conversations import read_conversations
from dflash.data.ingest import Tally, open_records
from dflash.errors import UserError

DEFAULT_MODE = "default"
"""The one mode of a set that names none: ``evaluate``'s template options."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    mode: str
    tools: bool
    """The prompt carries tool schemas, tool calls or tool results."""


@dataclass
class PromptSet:
    name: str
    prompts: list[Prompt]
    modes: list[str]
    max_new_tokens: int
    records: dict = field(default_factory=dict)
    """How it was read: records (conversations), prompts taken, skipped by reason."""


def template_kwargs(config: Config) -> dict:
    """The template options prompts are rendered with: evaluate's own, else the training data's."""
    own = config.evaluate.chat_template_kwargs
    return dict(own if own is not None else config.data.chat_template_kwargs)


def cut_point(messages: list[dict], rng: np.random.Generator, open_end: bool) -> int | None:
    """Where the prompt ends: before a seeded random assistant turn, or (``open_end``) at the
    end of a conversation whose last turn awaits an answer; None when neither exists."""
    if open_end and messages[-1]["role"] != "assistant":
        return len(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return turns[int(rng.integers(len(turns)))] if turns else None


def uses_tools(conversation: dict, messages: list[dict]) -> bool:
    return bool(conversation.get("tools")) or any(
        m["role"] == "tool" or m.get("tool_calls") for m in messages
    )


def render_prompts(
    conversations: Iterable[dict],
    tokenizer,
    modes: dict[str, dict],
    budget: int,
    count: int,
    seed: int,
    open_end: bool,
    skipped: dict,
) -> list[Prompt]:
    """The first ``count`` conversations by id that give a prompt, each in every mode; the
    prompt keeps its last ``budget`` tokens. A conversation the template refuses is counted in
    ``skipped['template_error']``."""
    rng = np.random.default_rng(seed)
    renders = {mode: template_renderer(tokenizer, options) for mode, options in modes.items()}
    prompts: list[Prompt] = []
    taken = 0
    for conv in sorted(conversations, key=lambda c: c["conversation_id"]):
        if taken == count:
            break
        cut = cut_point(conv["messages"], rng, open_end)
        if cut is None:
            continue
        head, tools = conv["messages"][:cut], conv.get("tools")
        try:
            texts = {m: r(head, True, tools) for m, r in renders.items()}
        except TEMPLATE_FAILURES:
            skipped["template_error"] = skipped.get("template_error", 0) + 1
            continue
        taken += 1
        for mode, text in texts.items():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append(Prompt(list(ids)[-budget:], mode, uses_tools(conv, head)))
    return prompts


def read_prompt_file(path: str, key: str, roots: tuple[Path, ...]) -> tuple[list[dict], dict]:
    """The conversations of a set's file under ``roots`` (as for ``open_records``), and how it
    was read (the counts ingest reports)."""
    tally = Tally(need_answer=False)
    conversations = []
    for number, record in open_records(path, key, roots):
        accepted = tally.accept(number, record)
        if accepted is not None:
            conversations.append(accepted[0])
    skipped = {reason: e["count"] for reason, e in tally.skipped.items() if e["count"]}
    return conversations, {
        "records_read": tally.records_read,
        "skipped": skipped,
        "duplicates_removed": tally.duplicates["count"],
    }


def prompt_sets(
    config: Config, tokenizer, heldout: Path, roots: tuple[Path, ...]
) -> list[PromptSet]:
    """The ``heldout`` split first, then every set of ``evaluate.sets`` (files under ``roots``)
    in the order given."""
    ev = config.evaluate
    specs = {HELDOUT_SET: ev.sets.get(HELDOUT_SET, PromptSetConfig())}
    specs |= {name: spec for name, spec in ev.sets.items() if name != HELDOUT_SET}
    out, base = [], template_kwargs(config)
    for name, spec in specs.items():
        modes = {m: base | options for m, options in (spec.modes or {DEFAULT_MODE: {}}).items()}
        new_tokens = spec.max_new_tokens or ev.max_new_tokens
        if spec.path is None:
            conversations = read_conversations(heldout)
            records = {"records_read": len(conversations), "skipped": {}}
        else:
            conversations, records = read_prompt_file(
                spec.path, f"evaluate.sets.{name}.path", roots
            )
        prompts = render_prompts(
            conversations,
            tokenizer,
            modes,
            config.data.max_seq_len - new_tokens,
            spec.num_prompts or ev.num_prompts,
            ev.seed,
            open_end=spec.path is not None,
            skipped=records["skipped"],
        )
        if not prompts:
            where = spec.path or str(heldout)
            raise UserError(f"evaluate.sets.{name}: {where} gives no prompt to score {records}")
        records["prompts"] = len(prompts) // len(modes)
        out.append(PromptSet(name, prompts, list(modes), new_tokens, records))
    return out
