"""Token cost of the ``data.turns`` policies: samples, tokens, loss tokens and assistant turns
learned or left out (per reason), each conversation encoded uncut.

Built-in corpora, made in code from the default corpus (the first ``--max-conversations``
chitchat chats, as ingest reads them):

- ``default``: the chats, with a byte-level BPE trained on them as the tokenizer stage does
  (ChatML, ``tokenizer.vocab_size`` 4,096): what a default run tokenizes.
- ``thinking``: every answer given a reasoning (its own words, restated), one answer per user
  query, through ``--tokenizer`` (a Qwen3 tokenizer: its template drops the reasoning of
  turns before the last user query).
- ``agent``: the same, each answer reached through a chain of 0 to 3 tool calls, each with
  its reasoning (agentic thinking data: several assistant turns per user query).

Or any conversations Parquet file (``data/ingested``, ``data/regenerated``):

    .venv/bin/python bench/turn_policy_cost.py --corpus default thinking agent \\
        --tokenizer ../shared/fixtures/qwen3-tokenizer --max-conversations 200
    .venv/bin/python bench/turn_policy_cost.py --tokenizer models/tokenizer \\
        --conversations data/ingested/conversations.parquet --kwargs '{"enable_thinking": false}'
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter

import numpy as np

from dflash.data.chat import TURN_POLICIES, encode_chats
from dflash.data.chitchat import load_chitchat
from dflash.data.conversations import read_conversations
from dflash.data.records import RecordError, parse_record
from dflash.data.tokenizer import add_mask_token, load_tokenizer, train_tokenizer

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Search notes for a phrase",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}


def chitchat(n: int) -> list[dict]:
    """The first ``n`` chats of the default corpus that ingest keeps, parsed as it does."""
    return list(itertools.islice(filter(None, map(_parsed, load_chitchat())), n))


def _parsed(entry: tuple[dict, int]) -> dict | None:
    try:
        return parse_record(entry[0])
    except RecordError:
        return None


def with_reasoning(rows: list[dict]) -> list[dict]:
    """Every assistant answer gets a reasoning about as long as the answer itself."""
    for row in rows:
        for message in row["messages"]:
            if message["role"] == "assistant" and not message.get("tool_calls"):
                words = message["content"].split()
                message["reasoning_content"] = "The user wants a reply. " + " ".join(words)
    return rows


def with_tool_chains(rows: list[dict]) -> list[dict]:
    """Before the answer to user query ``q`` of chat ``c``, ``(c + q) % 4`` tool calls, each
    with its reasoning and its result: several assistant turns per query."""
    for c, row in enumerate(rows):
        messages, query = [], 0
        for message in row["messages"]:
            if message["role"] == "assistant":
                messages += _chain(message["content"], c + query, (c + query) % 4)
                query += 1
            messages.append(message)
        row["messages"], row["tools"] = messages, [LOOKUP]
    return rows


def _chain(answer: str, key: int, calls: int) -> list[dict]:
    words = answer.split()[:4] or ["notes"]
    chain = []
    for k in range(calls):
        call_id = f"call{key:05d}{k}"[-9:]
        arguments = json.dumps({"query": " ".join(words[: k + 1])})
        chain += [
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"I should search my notes for {words[k % len(words)]}.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "lookup", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "name": "lookup", "content": answer},
        ]
    return chain


def cost(tokenizer, rows: list[dict], turns: str, options: dict) -> dict:
    tokens = loss = samples = learned = 0
    skipped: Counter[str] = Counter()
    for encoded, plan in encode_chats(tokenizer, rows, turns, options, special_tokens="keep"):
        samples += len(encoded)
        tokens += sum(len(ids) for ids, _ in encoded)
        loss += sum(int(np.count_nonzero(mask)) for _, mask in encoded)
        learned += plan.learned
        skipped.update(reason for _, reason in plan.skipped)
    return {
        "samples": samples,
        "tokens": tokens,
        "loss_tokens": loss,
        "tokens_per_loss_token": round(tokens / max(loss, 1), 2),
        "turns_learned": learned,
        "turns_left_out": dict(skipped),
    }


def corpus(name: str, args) -> tuple[list[dict], object]:
    """The conversations and the tokenizer of a built-in corpus."""
    rows = chitchat(args.max_conversations)
    if name == "default":
        texts = (m["content"] for row in rows for m in row["messages"])
        tokenizer = train_tokenizer(texts, 4096)
        add_mask_token(tokenizer)
        return rows, tokenizer
    if args.tokenizer is None:
        raise SystemExit(f"--corpus {name} needs --tokenizer (a Qwen3 tokenizer directory)")
    rows = with_reasoning(rows)
    return (with_tool_chains(rows) if name == "agent" else rows), load_tokenizer(args.tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", nargs="+", choices=("default", "thinking", "agent"))
    parser.add_argument("--conversations", help="a conversations Parquet file instead")
    parser.add_argument("--tokenizer")
    parser.add_argument("--kwargs", default="{}", help="chat_template_kwargs as JSON")
    parser.add_argument("--thinking", action="store_true", help="add a reasoning to every answer")
    parser.add_argument("--max-conversations", type=int, default=1000, help="the first N only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    options = json.loads(args.kwargs)
    results = {}
    if args.conversations:
        rows = read_conversations(args.conversations)[: args.max_conversations]
        rows = with_reasoning(rows) if args.thinking else rows
        results[args.conversations] = (rows, load_tokenizer(args.tokenizer))
    for name in args.corpus or ():
        results[name] = corpus(name, args)
    for name, (rows, tokenizer) in results.items():
        result = {turns: cost(tokenizer, rows, turns, options) for turns in TURN_POLICIES}
        if args.json:
            print(json.dumps({"corpus": name, "conversations": len(rows), **result}))
            continue
        print(f"{name} ({len(rows)} conversations)")
        for turns, figures in result.items():
            print(f"{turns:>18}: {json.dumps(figures)}")


if __name__ == "__main__":
    main()
