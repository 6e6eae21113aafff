"""Chat-template encoding with an assistant-only loss mask that works for any template.

The mask is found from text, not from one template's markup: the conversation is rendered
once, and each assistant content is located after the rendering of the messages before it
with the generation prompt (the text a served target sees before it answers). The fast
tokenizer's offset mapping then turns those character spans into tokens. The special
token right after an assistant content (``<|im_end|>``, ``<|eot_id|>``, ...) is learned
too, because predicting the end of a turn is part of drafting it. An assistant turn that
calls tools is learned whole, content and calls, whatever markup the template gives them;
tool results, like user turns, are not learned.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence

import jinja2
import numpy as np
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

Span = tuple[int, int]


class ChatTemplateError(ValueError):
    """The chat template changed an assistant content beyond recognition."""


def template_renderer(tokenizer: PreTrainedTokenizerFast) -> Callable[..., str]:
    """Render ``messages`` exactly as ``apply_chat_template(tokenize=False)`` does.

    The compiled template is the one ``apply_chat_template`` uses; calling it directly skips
    per-call copying of the messages, which makes rendering every prefix ~5x cheaper.
    """
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"{tokenizer.name_or_path}: the tokenizer has no chat_template")
    template = _compile_jinja_template(tokenizer.chat_template)
    special = dict(tokenizer.special_tokens_map)

    def render(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **special
        )

    return render


def assistant_spans(
    render: Callable[..., str], messages: Sequence[dict], text: str, limit: int | None = None
) -> list[Span]:
    """Character spans of the assistant contents in ``text``, the rendered ``messages``.

    Messages that start at or after character ``limit`` are skipped: truncation cuts them.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _prompt(render, messages[:i])
        start = len(prompt) if text.startswith(prompt) else _common_prefix(prompt, text)
        if limit is not None and start >= limit:
            break
        if message.get("tool_calls"):
            spans.append(_turn_span(render, messages[: i + 1], text, start))
            continue
        content = message["content"]
        at = text.find(content, start)
        if at < 0:
            content = content.strip()
            at = text.find(content, start)
        if at < 0:
            raise ChatTemplateError(
                f"assistant message {i} does not appear in the rendered chat: the template "
                f"rewrites it, so its loss mask cannot be found. Content: {message['content']!r}"
            )
        spans.append((at, at + len(content)))
    return spans


def _prompt(render: Callable[..., str], before: Sequence[dict]) -> str:
    """What the target sees before it answers; for a first turn, templates that cannot
    render an empty chat give no prompt (searching then starts at the beginning)."""
    try:
        return render(before, add_generation_prompt=True)
    except jinja2.TemplateError:
        if before:
            raise
        return ""


def _turn_span(render: Callable[..., str], upto: Sequence[dict], text: str, start: int) -> Span:
    """The whole rendered turn of the last message of ``upto``, from ``start``.

    A tool call's markup is the template's own (``<tool_call>``, ``[TOOL_CALLS]``, ...), so
    the turn is found as the text the message adds to the chat rather than by searching
    for its content. Trailing whitespace is left out, as it is outside a content span.
    """
    turn = render(upto)
    end = len(turn) if text.startswith(turn) else _common_prefix(turn, text)
    return start, start + len(text[start:end].rstrip())


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, for templates whose prompt is not a prefix of the chat."""
    return len(os.path.commonprefix([a, b]))


def end_of_turn_ids(tokenizer: PreTrainedTokenizerFast) -> frozenset[int]:
    """Ids of every special token: any of them right after a content closes the turn."""
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(special)


def loss_mask(
    ids: np.ndarray, offsets: np.ndarray, spans: list[Span], ends: frozenset[int]
) -> np.ndarray:
    """1 on tokens overlapping an assistant span and on a special token right after it."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    starts, stops = offsets[:, 0], offsets[:, 1]
    for begin, end in spans:
        mask[(starts < end) & (stops > begin)] = 1
        after = int(np.searchsorted(starts, end, side="left"))
        if after < len(ids) and int(ids[after]) in ends:
            mask[after] = 1
    return mask


def encode_conversations(
    tokenizer: PreTrainedTokenizerFast,
    conversations: Sequence[Sequence[dict]],
    max_tokens: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batch version of :func:`encode_conversation`: one fast-tokenizer call for all.

    With ``max_tokens`` every sample is cut to at most that many tokens, and the loss mask is
    only searched for in the part that is kept, which saves most of the work on long chats.
    """
    render = template_renderer(tokenizer)
    texts = [render(messages) for messages in conversations]
    ends = end_of_turn_ids(tokenizer)
    results = []
    for messages, text, encoding in zip(
        conversations, texts, _encode_batch(tokenizer, texts), strict=True
    ):
        ids = encoding.ids[:max_tokens]
        offsets = encoding.offsets[:max_tokens]
        ids = np.fromiter(ids, dtype=np.uint32, count=len(ids))
        flat = itertools.chain.from_iterable(offsets)
        offsets = np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
        limit = int(offsets[-1, 1]) if max_tokens is not None and len(ids) else None
        spans = assistant_spans(render, messages, text, limit)
        results.append((ids, loss_mask(ids, offsets, spans, ends)))
    return results


def _encode_batch(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list:
    """The Rust tokenizer's encodings of ``texts``, as ``tokenizer(texts)`` computes them.

    Calling the backend directly skips converting every encoding to Python lists twice;
    truncation and padding are switched off first, as ``tokenizer(texts)`` would.
    """
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    return backend.encode_batch(texts, add_special_tokens=False)


def encode_conversation(
    tokenizer: PreTrainedTokenizerFast, messages: Sequence[dict], max_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32) and loss mask (uint8, 1 = learn) of one templated conversation."""
    return encode_conversations(tokenizer, [messages], max_tokens)[0]
