"""Chat-template encoding: a training sample is what the target sees when it serves a turn.

An assistant turn, as served, is a prompt (the messages before it rendered with the generation
prompt, the template's options and the conversation's tools) and an output: what the template
adds when the turn itself is rendered last, reasoning, tool-call markup and end-of-turn token
included. Nothing about one template's markup is assumed; only text is compared, and the fast
tokenizer's offset mapping turns character spans into tokens.

Three ways to make samples of a conversation (``data.turns``):

- ``per_conversation``: the whole chat rendered once; a turn is learned where the template
  shows its served output in full. Templates that rewrite history (Qwen3 drops the reasoning
  of turns before the last user query) show only their later turns in full: the others are
  left out as ``not_shown_in_full``. Cheap: every token is in one sample.
- ``per_turn``: one sample per assistant turn, its prompt then its output: each turn is
  learned with its reasoning, in exactly the context the target served it in, at the cost of
  repeating the history once per turn.
- ``auto`` (the default): the whole chat when it shows every turn as served; else also,
  working back from the last turn it hides, that turn as served, which learns every hidden
  turn its history shows, until none is hidden. Every turn is learned in its served context,
  in as few samples as the template allows: for Qwen3 one per user query.

User, system and tool-result text is never learned. A turn that cannot be mapped is left out
with a reason (:data:`SKIP_REASONS`) for the tokenize report, never an exception.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jinja2
import numpy as np
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

from dflash.data.specials import SPECIAL_CONTENT, ContentSpecials, Escaped, encode_escaped

Span = tuple[int, int]
Render = Callable[..., str]
TURN_POLICIES = ("auto", "per_conversation", "per_turn")
SKIP_REASONS = (
    "template_error",
    "prompt_not_continued",
    "content_rewritten",
    "not_shown_in_full",
    "special_tokens_in_content",
)
"""Why an assistant turn is left out: the template raised on the chat; it renders the turn
differently from the prompt it serves (e.g. reasoning in the data under ``enable_thinking:
false``); its rendering lacks the message's content; or (``per_conversation``) the whole chat
does not show its served output; or its conversation's text holds special-token strings
and ``data.special_tokens_in_content`` is ``drop``."""
TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)
"""What rendering a chat the template was not written for can raise."""


class ChatTemplateError(ValueError):
    """The chat template changed an assistant content beyond recognition."""


def template_renderer(tokenizer: PreTrainedTokenizerFast, options: Mapping | None = None) -> Render:
    """Render a chat exactly as ``apply_chat_template(messages, tools=tools, **options,
    tokenize=False)`` does: the one rendering regenerate, tokenize and evaluate share.

    The compiled template is the one ``apply_chat_template`` uses; calling it directly skips
    per-call copying of the messages, which makes rendering every prefix ~5x cheaper.
    """
    if not tokenizer.chat_template:
        raise ChatTemplateError(f"{tokenizer.name_or_path}: the tokenizer has no chat_template")
    template = _compile_jinja_template(tokenizer.chat_template)
    context = {**tokenizer.special_tokens_map, **(options or {})}

    def render(
        messages: Sequence[dict], add_generation_prompt: bool = False, tools: list | None = None
    ) -> str:
        return template.render(
            messages=[_aliased(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    return render


def _aliased(message: dict) -> dict:
    """Reasoning also under ``thinking``, the name gpt-oss templates read, as Hugging Face
    hands it to templates."""
    reasoning = message.get("reasoning_content")
    return message if reasoning is None else {"thinking": reasoning, **message}


@dataclass(frozen=True)
class Turn:
    """One assistant turn as served: the prompt the target sees and the output it writes."""

    index: int
    prompt: str
    output: str


def served_turn(render: Render, messages: Sequence[dict], i: int, tools=None) -> Turn | str:
    """Assistant turn ``i`` as the target serves it, or the reason it cannot be mapped."""
    try:
        prompt = _prompt(render, messages[:i], tools)
        rendered = render(messages[: i + 1], tools=tools)
    except TEMPLATE_FAILURES:
        return "template_error"
    if rendered.startswith(prompt):
        output = rendered[len(prompt) :]
    else:
        anchor = messages[i - 1]["content"].strip() if i else ""
        output = _continuation(prompt, rendered, anchor)
        if output is None:
            return "prompt_not_continued"
    output = output.rstrip()
    if not _shows_content(messages[i], output):
        return "content_rewritten"
    return Turn(i, prompt, output)


def _continuation(prompt: str, rendered: str, anchor: str) -> str | None:
    """What ``rendered`` adds after ``prompt`` when the template rewrites the prompt's history
    once the turn follows it (Mistral puts the system prompt into the last user message only).

    The output starts where ``rendered`` continues the longest tail of the prompt that still
    holds ``anchor``, the last message before the turn; None when no such tail is continued
    (e.g. reasoning in the data where the prompt closes an empty think block).
    """
    diverge = _common_prefix(prompt, rendered)
    rest = rendered[diverge:]
    for start in range(diverge, len(prompt)):
        tail = prompt[start:]
        if anchor not in tail:
            return None
        if rest.startswith(tail):
            return rest[len(tail) :]
    return None


def _prompt(render: Render, before: Sequence[dict], tools) -> str:
    """What the target sees before it answers; for a first turn, templates that cannot
    render an empty chat give no prompt."""
    try:
        return render(before, add_generation_prompt=True, tools=tools)
    except TEMPLATE_FAILURES:
        if before:
            raise
        return ""


def _shows_content(message: dict, output: str) -> bool:
    """Whether the output holds the message's answer (after any inline reasoning). A turn that
    calls tools is the template's own markup, which may leave its content out."""
    if message.get("tool_calls"):
        return True
    return message["content"].rpartition("</think>")[2].strip() in output


@dataclass
class ChatSamples:
    """A conversation's samples as (text, learned spans), and its assistant turns' fate."""

    samples: list[tuple[str, list[Span]]] = field(default_factory=list)
    learned: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(message index, reason) of every assistant turn left out."""
    special_tokens_in_content: bool = False
    """Whether the conversation's text holds special-token strings."""


def assistant_indices(messages: Sequence[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def per_turn_samples(render: Render, messages: Sequence[dict], tools=None) -> ChatSamples:
    """One sample per assistant turn: its prompt, then its output (learned)."""
    out = ChatSamples()
    for i in assistant_indices(messages):
        turn = served_turn(render, messages, i, tools)
        if isinstance(turn, str):
            out.skipped.append((i, turn))
            continue
        start = len(turn.prompt)
        out.samples.append((turn.prompt + turn.output, [(start, start + len(turn.output))]))
        out.learned += 1
    return out


def served_turns(
    render: Render, messages: Sequence[dict], tools=None
) -> tuple[list[Turn], list[tuple[int, str]]]:
    """Every assistant turn as served, and (index, reason) of each that cannot be mapped."""
    turns, skipped = [], []
    for i in assistant_indices(messages):
        turn = served_turn(render, messages, i, tools)
        if isinstance(turn, str):
            skipped.append((i, turn))
        else:
            turns.append(turn)
    return turns, skipped


def conversation_sample(
    render: Render,
    messages: Sequence[dict],
    tools: list | None,
    text: str | None,
    limit: int | None = None,
) -> ChatSamples:
    """The whole chat ``text`` (None: the template failed on it) as one sample, learning each
    turn whose served output it shows in full.

    Turns that start at or after character ``limit`` are not looked at: truncation cuts them.
    """
    out, _, hidden = _whole_chat(render, messages, tools, text, limit)
    out.skipped = sorted(out.skipped + [(turn.index, "not_shown_in_full") for turn in hidden])
    return out


def auto_samples(
    render: Render,
    messages: Sequence[dict],
    tools: list | None,
    text: str | None,
    limit: int | None = None,
) -> ChatSamples:
    """The whole chat ``text`` when it shows every turn as served; else also, while a turn is
    hidden, the last hidden turn as served, learning every hidden turn its history shows.

    Working back from the end gives the fewest samples for templates that rewrite a turn
    once a later user query follows it (Qwen3): one sample per user query, a tool-calling
    chain after one query staying whole. Turns truncation cuts from the whole chat (at
    ``limit``) are cut here too: any sample holding them is at least as long.
    """
    out, turns, hidden = _whole_chat(render, messages, tools, text, limit)
    extra: list[tuple[str, list[Span]]] = []
    while hidden:
        last, earlier = hidden[-1], hidden[:-1]
        spans, hidden = _shown_outputs(render, messages, tools, earlier, last.prompt)
        start = len(last.prompt)
        extra.append((last.prompt + last.output, [*spans, (start, start + len(last.output))]))
        out.learned += len(spans) + 1
    if extra and not out.samples[0][1]:
        out.samples = []
    out.samples[:0] = extra[::-1]
    return out


def _whole_chat(
    render: Render, messages: Sequence[dict], tools, text: str | None, limit: int | None
) -> tuple[ChatSamples, list[Turn], list[Turn]]:
    """The whole chat as one sample, the turns as served, and those it does not show."""
    out = ChatSamples()
    if text is None:
        out.skipped = [(i, "template_error") for i in assistant_indices(messages)]
        return out, [], []
    turns, out.skipped = served_turns(render, messages, tools)
    spans, hidden = _shown_outputs(render, messages, tools, turns, text, limit)
    out.samples.append((text, spans))
    out.learned = len(spans)
    return out, turns, hidden


def _shown_outputs(
    render: Render,
    messages: Sequence[dict],
    tools,
    turns: Sequence[Turn],
    text: str,
    limit: int | None = None,
) -> tuple[list[Span], list[Turn]]:
    """Spans of the ``turns`` whose served output ``text`` shows in full, and the turns it
    does not show; turns starting at or after ``limit`` are neither."""
    spans: list[Span] = []
    hidden: list[Turn] = []
    searched = 0
    for turn in turns:
        i = turn.index
        start = max(_turn_start(render, messages[:i], tools, turn.prompt, text), searched)
        if limit is not None and start >= limit:
            break
        at = text.find(turn.output, start)
        if at < 0:
            hidden.append(turn)
            continue
        searched = at + len(turn.output)
        spans.append((at, searched))
    return spans, hidden


def _turn_start(render: Render, before: Sequence[dict], tools, prompt: str, text: str) -> int:
    """Where a turn's search starts: after its prompt, or, for a generation prompt that is not
    a prefix of the rendered chat (Qwen3 without thinking), after the chat before the turn."""
    if text.startswith(prompt):
        return len(prompt)
    try:
        history = render(before, tools=tools) if before else ""
    except TEMPLATE_FAILURES:
        history = ""
    if history and text.startswith(history):
        return len(history)
    return _common_prefix(prompt, text)


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


def encode_chats(
    tokenizer: PreTrainedTokenizerFast,
    chats: Sequence[Mapping],
    turns: str = "auto",
    options: Mapping | None = None,
    max_tokens: int | None = None,
    special_tokens: str = "drop",
) -> list[tuple[list[tuple[np.ndarray, np.ndarray]], ChatSamples]]:
    """Samples of every chat (``{"messages", "tools"?}``): token ids (uint32) and loss mask
    (uint8, 1 = learn) per sample, with the chat's :class:`ChatSamples` (texts dropped).

    Few fast-tokenizer calls for all. With ``max_tokens`` every sample is cut to at most that
    many tokens; ``per_conversation`` and ``auto`` then search the mask only in the part of
    the whole chat that is kept, which saves most of the work on long chats.
    ``special_tokens`` is what a chat holding special-token strings in its text becomes
    (:mod:`dflash.data.specials`).
    """
    if turns not in TURN_POLICIES:
        raise ValueError(f"turns = {turns!r}: allowed are {', '.join(TURN_POLICIES)}")
    if special_tokens not in SPECIAL_CONTENT:
        raise ValueError(f"special_tokens = {special_tokens!r}: allowed are {SPECIAL_CONTENT}")
    render = template_renderer(tokenizer, options)
    screen = ContentSpecials(tokenizer)
    screened = [_screened(screen, chat, special_tokens) for chat in chats]
    wholes: list[str | None] = [None] * len(chats)
    known: dict[tuple[int, str], object] = {}
    if turns != "per_turn":
        wholes = [None if s.dropped else _render_chat(render, s.chat) for s in screened]
        rendered = [(k, text) for k, text in enumerate(wholes) if text is not None]
        known = _encoded(tokenizer, rendered, screened)
    plans = [
        _plan(render, s, turns, text, _limit(known.get((k, text)), max_tokens))
        for k, (s, text) in enumerate(zip(screened, wholes, strict=True))
    ]
    texts = [(k, text) for k, plan in enumerate(plans) for text, _ in plan.samples]
    known.update(_encoded(tokenizer, [key for key in texts if key not in known], screened))
    ends = end_of_turn_ids(tokenizer)
    results = []
    for k, plan in enumerate(plans):
        encoded = []
        for text, spans in plan.samples:
            ids, offsets = _arrays(known[k, text], max_tokens)
            encoded.append((ids, loss_mask(ids, offsets, spans, ends)))
        plan.samples = []
        results.append((encoded, plan))
    return results


@dataclass(frozen=True)
class _Screened:
    """A chat as it is rendered, once its special-token strings have been looked for."""

    chat: Mapping
    held: bool
    """Whether its text holds special-token strings."""
    dropped: bool
    escaped: Escaped | None
    """Its placeholders, when its strings are escaped (``chat`` is then ``escaped.chat``)."""


def _screened(screen: ContentSpecials, chat: Mapping, special_tokens: str) -> _Screened:
    held = screen.held(chat)
    if held and special_tokens == "escape":
        escaped = screen.escaped(dict(chat))
        return _Screened(escaped.chat, True, False, escaped)
    return _Screened(chat, held, held and special_tokens == "drop", None)


def _plan(
    render: Render, screened: _Screened, turns: str, text: str | None, limit: int | None
) -> ChatSamples:
    """The samples of one chat as texts and learned spans, per ``data.turns``."""
    messages, tools = screened.chat["messages"], screened.chat.get("tools")
    render = _prefix_cache(render)
    if screened.dropped:
        reason = "special_tokens_in_content"
        plan = ChatSamples(skipped=[(i, reason) for i in assistant_indices(messages)])
    elif turns == "per_turn":
        plan = per_turn_samples(render, messages, tools)
    else:
        sampler = auto_samples if turns == "auto" else conversation_sample
        plan = sampler(render, messages, tools, text, limit)
    plan.special_tokens_in_content = screened.held
    return plan


def _prefix_cache(render: Render) -> Render:
    """``render`` for the prefixes of one conversation, each rendered once: the searches of
    several samples render the same history again (a render is milliseconds)."""
    memo: dict[tuple[int, bool], str] = {}

    def cached(
        messages: Sequence[dict], add_generation_prompt: bool = False, tools: list | None = None
    ) -> str:
        key = (len(messages), add_generation_prompt)
        if key not in memo:
            memo[key] = render(messages, add_generation_prompt, tools)
        return memo[key]

    return cached


def _encoded(
    tokenizer: PreTrainedTokenizerFast, keyed: list[tuple[int, str]], screened: list[_Screened]
) -> dict[tuple[int, str], object]:
    """The encoding of each (chat number, sample text): in one batch, but for escaped chats."""
    plain = [(k, text) for k, text in keyed if screened[k].escaped is None]
    out: dict[tuple[int, str], object] = dict(
        zip(plain, _encode_batch(tokenizer, [text for _, text in plain]), strict=True)
    )
    for k, text in keyed:
        if screened[k].escaped is not None:
            out[k, text] = encode_escaped(tokenizer, text, screened[k].escaped)
    return out


def _render_chat(render: Render, chat: Mapping) -> str | None:
    try:
        return render(chat["messages"], tools=chat.get("tools"))
    except TEMPLATE_FAILURES:
        return None


def _limit(encoding, max_tokens: int | None) -> int | None:
    """The character where a sample cut to ``max_tokens`` ends (None: nothing is cut)."""
    if encoding is None or max_tokens is None or not encoding.offsets[:max_tokens]:
        return None
    return encoding.offsets[:max_tokens][-1][1]


def _arrays(encoding, max_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    ids = encoding.ids[:max_tokens]
    offsets = encoding.offsets[:max_tokens]
    ids = np.fromiter(ids, dtype=np.uint32, count=len(ids))
    flat = itertools.chain.from_iterable(offsets)
    offsets = np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
    return ids, offsets


def encode_conversations(
    tokenizer: PreTrainedTokenizerFast,
    conversations: Sequence[Sequence[dict]],
    max_tokens: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each conversation as one sample (``per_conversation``), every assistant turn learned.

    Strict, for callers that expect every turn to be mapped: a turn left out is an error.
    """
    chats = [{"messages": messages} for messages in conversations]
    results = []
    for messages, (encoded, samples) in zip(
        conversations,
        encode_chats(tokenizer, chats, "per_conversation", None, max_tokens, "keep"),
        strict=True,
    ):
        if samples.skipped:
            i, reason = samples.skipped[0]
            raise ChatTemplateError(
                f"assistant message {i} does not appear in the rendered chat ({reason}): the "
                f"template rewrites it, so its loss mask cannot be found. "
                f"Content: {messages[i]['content']!r}"
            )
        results.append(encoded[0])
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
