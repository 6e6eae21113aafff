"""The default corpus: the ``chitchat_dataset`` package, real two-person chats.

Each chat is a list of groups, one group per run of messages from one sender. A turn of
our schema is one speaker's consecutive messages joined by newlines; the person who speaks
first plays the user, the other the assistant, so turns alternate user/assistant.
"""

from __future__ import annotations

from collections.abc import Iterator

import chitchat_dataset

ROLES = ("user", "assistant")


def chat_to_record(chat_id: str, chat: dict) -> tuple[dict, int]:
    """One chat as an OpenAI-style record, and how many blank messages it left out."""
    turns: list[tuple[str, list[str]]] = []
    blank = 0
    for group in chat["messages"]:
        for message in group:
            text, sender = message["text"], message["sender"]
            if not text.strip():
                blank += 1
            elif turns and turns[-1][0] == sender:
                turns[-1][1].append(text)
            else:
                turns.append((sender, [text]))
    messages = [
        {"role": ROLES[i % 2], "content": "\n".join(texts)} for i, (_, texts) in enumerate(turns)
    ]
    return {"id": chat_id, "messages": messages}, blank


def load_chitchat() -> Iterator[tuple[dict, int]]:
    """Every chat of the installed package, in the package's order."""
    for chat_id, chat in chitchat_dataset.Dataset().items():
        yield chat_to_record(chat_id, chat)
