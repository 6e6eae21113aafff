"""Token cost of the two ``data.turns`` policies on a conversations file, for any tokenizer.

Encodes every conversation of a conversations Parquet file (the format ``data/ingested`` and
``data/regenerated`` hold) both ways, uncut, and prints per policy the samples, tokens, loss
tokens and assistant turns learned or left out (per reason):

    .venv/bin/python bench/turn_policy_cost.py data/ingested/conversations.parquet \\
        --tokenizer models/tokenizer
    .venv/bin/python bench/turn_policy_cost.py chats.parquet --tokenizer ../shared/fixtures/\\
qwen3-tokenizer --kwargs '{"enable_thinking": false}' --json

``--thinking`` first gives every assistant turn a reasoning (its answer's first words, restated)
so a corpus without reasoning can stand in for what a thinking target regenerates.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from dflash.data.chat import TURN_POLICIES, encode_chats
from dflash.data.conversations import read_conversations
from dflash.data.tokenizer import load_tokenizer


def with_reasoning(rows: list[dict]) -> list[dict]:
    """Every assistant answer gets a reasoning about as long as the answer itself."""
    for row in rows:
        for message in row["messages"]:
            if message["role"] == "assistant" and not message.get("tool_calls"):
                words = message["content"].split()
                message["reasoning_content"] = "The user wants a reply. " + " ".join(words)
    return rows


def cost(tokenizer, rows: list[dict], turns: str, options: dict) -> dict:
    tokens = loss = samples = learned = 0
    skipped: Counter[str] = Counter()
    for encoded, plan in encode_chats(tokenizer, rows, turns, options):
        samples += len(encoded)
        tokens += sum(len(ids) for ids, _ in encoded)
        loss += sum(int(np.count_nonzero(mask)) for _, mask in encoded)
        learned += plan.learned
        skipped.update(reason for _, reason in plan.skipped)
    return {
        "samples": samples,
        "tokens": tokens,
        "loss_tokens": loss,
        "tokens_per_loss_token": tokens / max(loss, 1),
        "turns_learned": learned,
        "turns_left_out": dict(skipped),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("conversations")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--kwargs", default="{}", help="chat_template_kwargs as JSON")
    parser.add_argument("--thinking", action="store_true", help="add a reasoning to every answer")
    parser.add_argument("--max-conversations", type=int, help="the first N only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    rows = read_conversations(args.conversations)[: args.max_conversations]
    if args.thinking:
        rows = with_reasoning(rows)
    options = json.loads(args.kwargs)
    result = {turns: cost(tokenizer, rows, turns, options) for turns in TURN_POLICIES}
    if args.json:
        print(json.dumps({"conversations": len(rows), **result}))
        return
    for turns, figures in result.items():
        print(f"{turns:>16}: {json.dumps(figures)}")


if __name__ == "__main__":
    main()
