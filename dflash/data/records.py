"""Turn one raw input record into a normalized conversation, or say exactly why not.

Two record schemas are accepted: OpenAI ``messages`` (``role``/``content``, assistant
``tool_calls``, ``tool`` results) and ShareGPT ``conversations`` (``from``/``value``, with
``function_call`` and ``observation`` turns). A content may be a list of text parts, and the
turns field may be a JSON string (as Parquet exports of nested data often hold). Anything else
raises :class:`RecordError` whose ``reason`` is one of :data:`REASONS`, so ingest can count
every skipped record by cause.

A normalized message is ``{"role", "content"}`` with role ``system``, ``user``, ``assistant``
or ``tool``; an assistant message may add ``reasoning_content`` (also read from ``reasoning``
or ``thinking``) and ``tool_calls``, each ``{"type": "function", "function": {"name",
"arguments"}}`` with the arguments as JSON text and the call's ``id`` when it has one; a tool
message may add ``tool_call_id`` and ``name``. A conversation may carry ``tools``, the OpenAI
function schemas its target was served with (ShareGPT: a ``tools`` list or JSON text, or a
``system`` field holding one). That is everything chat templates read: the shape Hugging Face
``apply_chat_template(messages, tools=...)`` renders. Fields a record lacks stay absent.
"""

from __future__ import annotations

import hashlib
import json
import re

REASONS = (
    "invalid_utf8",
    "invalid_json",
    "too_deep",
    "too_long",
    "wrong_shape",
    "empty_content",
    "unknown_role",
    "no_assistant_turn",
)
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
BOM = b"\xef\xbb\xbf"
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: the only way a lone one gets into parsed text."""
SURROGATE = re.compile("[\ud800-\udfff]")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
"""Where records put an assistant's reasoning, first match wins; stored as ``reasoning_content``."""


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
    return _loads(text)


def _loads(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError("invalid_json", str(err)) from None
    except RecursionError:
        raise RecordError("too_deep", "nested deeper than the JSON parser goes") from None
    if SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise RecordError("invalid_utf8", "a \\u escape gives a lone surrogate, not a character")
    return value


def _embedded(text: str, what: str) -> object:
    """A field that holds JSON as text. The line itself parsed, so text that is not JSON makes
    the record the wrong shape, not ``invalid_json``."""
    try:
        return _loads(text)
    except RecordError as err:
        if err.reason != "invalid_json":
            raise
        raise RecordError("wrong_shape", f"{what} is text but not JSON") from None


def _has_lone_surrogate(value: object) -> bool:
    """Whether a key or string of ``value`` holds half a surrogate pair, which no UTF-8 text
    (hence no digest or Parquet file) can hold. A loop, not recursion: records nest deep."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and SURROGATE.search(item):
            return True
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_record(record: object, need_answer: bool = True) -> dict:
    """Normalize ``record`` to ``{"conversation_id", "messages": [...]}`` plus ``tools``.

    A prompt to be scored (``need_answer=False``) may hold no assistant turn yet."""
    if not isinstance(record, dict):
        raise RecordError("wrong_shape", f"record is a {type(record).__name__}, not an object")
    if record.get("messages") is not None:
        turns, parse_turn = record["messages"], _openai_turn
    elif record.get("conversations") is not None:
        turns, parse_turn = record["conversations"], _sharegpt_turn
    else:
        raise RecordError("wrong_shape", "neither a 'messages' nor a 'conversations' field")
    if isinstance(turns, str):
        turns = _embedded(turns, "the turns field")
    if not isinstance(turns, list) or not turns:
        raise RecordError("wrong_shape", "the turns field is not a non-empty list")
    messages = [parse_turn(turn, i) for i, turn in enumerate(turns)]
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "no turn has the assistant role")
    tools, system = record_tools(record, parse_turn is _sharegpt_turn)
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    conversation = {"conversation_id": record_id(record, messages, tools), "messages": messages}
    if tools:
        conversation["tools"] = tools
    return conversation


def record_tools(record: dict, sharegpt: bool) -> tuple[list[dict], str]:
    """The record's tool schemas, and a ShareGPT record-level system prompt (else "").

    ShareGPT exports keep both beside the turns, as JSON text or as values; a ``system`` field
    that holds a list of schemas is a tool list, not a prompt.
    """
    tools, system = record.get("tools"), record.get("system") if sharegpt else None
    if isinstance(system, str) and system.lstrip().startswith("["):
        system = _embedded(system, "system")
    if isinstance(system, list):
        tools, system = tools or system, None
    if isinstance(tools, str):
        tools = _embedded(tools, "tools") if tools.strip() else None
    if tools is None:
        return [], system if isinstance(system, str) else ""
    if not isinstance(tools, list):
        raise RecordError("wrong_shape", "tools is not a list of function schemas")
    return [_tool_schema(tool) for tool in tools], system if isinstance(system, str) else ""


def _tool_schema(tool: object) -> dict:
    """An OpenAI tool schema ``{"type": "function", "function": {"name", ...}}``; a bare
    function schema (ShareGPT exports) is wrapped into one."""
    if isinstance(tool, dict) and "function" not in tool and "name" in tool:
        tool = {"type": "function", "function": tool}
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError("wrong_shape", "a tool schema has no function name")
    return tool


def _openai_turn(turn: object, i: int) -> dict:
    role = OPENAI_ROLES[_role(turn, i, "role", OPENAI_ROLES)]
    calls = turn.get("tool_calls") if role == "assistant" else None
    tool_calls = [_tool_call(call, i) for call in _list(calls, i)] if calls else []
    message = _message(role, _text(turn.get("content"), i), tool_calls, i, _reasoning(turn, i))
    return _tool_result_ids(message, turn, i)


def _sharegpt_turn(turn: object, i: int) -> dict:
    sender = _role(turn, i, "from", SHAREGPT_ROLES)
    value = turn.get("value")
    if sender != "function_call":
        message = _message(SHAREGPT_ROLES[sender], _text(value, i), [], i, _reasoning(turn, i))
        return _tool_result_ids(message, turn, i)
    calls = _embedded(value, f"turn {i} function_call") if isinstance(value, str) else value
    calls = calls if isinstance(calls, list) else [calls]
    return _message("assistant", "", [_tool_call(call, i) for call in calls], i)


def _reasoning(turn: dict, i: int) -> str:
    """The reasoning an assistant turn carries beside its content, under any of its names."""
    if turn.get("role", turn.get("from")) not in ("assistant", "gpt"):
        return ""
    value = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), "")
    return _text(value, i)


def _tool_result_ids(message: dict, turn: dict, i: int) -> dict:
    """A tool result keeps the id of the call it answers and the tool's name (Mistral-style
    templates render both)."""
    if message["role"] != "tool":
        return message
    for key in ("tool_call_id", "name"):
        value = turn.get(key)
        if value is not None and not isinstance(value, str):
            raise RecordError("wrong_shape", f"turn {i} {key} is not a string")
        if value:
            message[key] = value
    return message


def _role(turn: object, i: int, key: str, roles: dict) -> str:
    if not isinstance(turn, dict):
        raise RecordError("wrong_shape", f"turn {i} is a {type(turn).__name__}, not an object")
    role = turn.get(key)
    if not isinstance(role, str) or role not in roles:
        raise RecordError("unknown_role", f"turn {i} has {key} = {role!r}")
    return role


def _text(content: object, i: int) -> str:
    """A content as text: a string, or a list of text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return "\n".join(part["text"] for part in content)
    raise RecordError("wrong_shape", f"turn {i} content is neither text nor text parts")


def _is_text_part(part: object) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


def _list(value: object, i: int) -> list:
    if not isinstance(value, list):
        raise RecordError("wrong_shape", f"turn {i} tool_calls is not a list")
    return value


def _tool_call(call: object, i: int) -> dict:
    """One call as ``{"type": "function", "function": {"name", "arguments": JSON text}}``."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise RecordError("wrong_shape", f"turn {i} has a tool call without a function name")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    normalized = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = call.get("id") if isinstance(call, dict) else None
    if call_id is not None and not isinstance(call_id, str):
        raise RecordError("wrong_shape", f"turn {i} has a tool call id that is not a string")
    if call_id:
        normalized["id"] = call_id
    return normalized


def _message(role: str, content: str, tool_calls: list[dict], i: int, reasoning: str = "") -> dict:
    if not tool_calls and not content.strip() and not reasoning.strip():
        raise RecordError("empty_content", f"turn {i} has no content")
    message = {"role": role, "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def record_id(record: dict, messages: list[dict], tools: list[dict] = ()) -> str:
    """The record's own ``id``/``conversation_id``, else a hash of its content (stable)."""
    for key in ("conversation_id", "id"):
        value = record.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return content_digest(messages, tools).hex()


def content_digest(messages: list[dict], tools: list[dict] = ()) -> bytes:
    """128-bit hash of the normalized messages (and tools, when there are any): equal exactly
    when the conversations are equal.

    Sixteen bytes a conversation is all deduplication keeps in memory.
    """
    content = [messages, list(tools)] if tools else messages
    canonical = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).digest()[:16]
