"""Turn one raw input record into a normalized conversation, or say exactly why not.

Two record schemas are accepted: OpenAI ``messages`` (``role``/``content``) and ShareGPT
``conversations`` (``from``/``value``). Anything else raises :class:`RecordError` whose
``reason`` is one of :data:`REASONS`, so ingest can count every skipped record by cause.
"""

from __future__ import annotations

import hashlib
import json

REASONS = (
    "invalid_utf8",
    "invalid_json",
    "wrong_shape",
    "empty_content",
    "unknown_role",
    "no_assistant_turn",
)
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


class RecordError(ValueError):
    """A record that cannot become a conversation; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode_line(raw: bytes) -> object:
    """Parse one JSONL line, telling bad encoding apart from bad JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecordError("invalid_utf8", str(err)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError("invalid_json", str(err)) from None


def parse_record(record: object) -> dict:
    """Normalize ``record`` to ``{"conversation_id", "messages": [{role, content}, ...]}``."""
    if not isinstance(record, dict):
        raise RecordError("wrong_shape", f"record is a {type(record).__name__}, not an object")
    if record.get("messages") is not None:
        turns, role_key, content_key, roles = record["messages"], "role", "content", OPENAI_ROLES
    elif record.get("conversations") is not None:
        turns, role_key, content_key, roles = (
            record["conversations"],
            "from",
            "value",
            SHAREGPT_ROLES,
        )
    else:
        raise RecordError("wrong_shape", "neither a 'messages' nor a 'conversations' field")
    if not isinstance(turns, list) or not turns:
        raise RecordError("wrong_shape", "the turns field is not a non-empty list")
    messages = [_parse_turn(turn, i, role_key, content_key, roles) for i, turn in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "no turn has the assistant role")
    return {"conversation_id": record_id(record, messages), "messages": messages}


def _parse_turn(turn: object, i: int, role_key: str, content_key: str, roles: dict) -> dict:
    if not isinstance(turn, dict):
        raise RecordError("wrong_shape", f"turn {i} is a {type(turn).__name__}, not an object")
    role = turn.get(role_key)
    if role not in roles:
        raise RecordError("unknown_role", f"turn {i} has {role_key} = {role!r}")
    content = turn.get(content_key)
    if content is not None and not isinstance(content, str):
        raise RecordError("wrong_shape", f"turn {i} {content_key} is a {type(content).__name__}")
    if not content or not content.strip():
        raise RecordError("empty_content", f"turn {i} has no {content_key}")
    return {"role": roles[role], "content": content}


def record_id(record: dict, messages: list[dict]) -> str:
    """The record's own ``id``/``conversation_id``, else a hash of its messages (stable)."""
    for key in ("conversation_id", "id"):
        value = record.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return content_hash(messages)


def content_hash(messages: list[dict]) -> str:
    """Hash of the normalized messages: equal exactly when the conversations are equal."""
    canonical = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]
