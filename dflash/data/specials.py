"""Special-token strings written in conversation text (``data.special_tokens_in_content``).

A fast tokenizer reads the string ``<|im_end|>`` as the control token wherever it stands, so
a record whose text holds one (a pasted transcript, a question about chat markup) would teach
the drafter a control id where the text has characters: an end of turn inside an answer, a
fake turn after it, the mask id. A conversation holding any is counted, and then:

- ``drop``: left out. The default: a target never writes a control token as text.
- ``escape``: kept, each such string tokenized as the plain text it is, exactly the ids the
  tokenizer gives when that token is not special, while the template's markup keeps its
  control ids. Exact, unlike inserting a zero-width character, which would teach the
  drafter a character the text does not have; and unlike ``split_special_tokens``, which
  would turn the template's own markup into text as well.
- ``keep``: tokenized as it is, as a serving engine that does not escape its input would.

Escaping works on positions, never on guessed markup: every string in the conversation's
text is replaced by a run of one private-use character of the same length before the
template renders it, so the rendered text has the template's markup as the only special
tokens and the very offsets of the real text. The tokenizer splits text at added tokens
before anything else, so each stretch between two of them is tokenized on its own; the
stretches holding an escaped string are tokenized again from the real text with special
tokens read as text (``encode_special_tokens``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_CONTENT = ("drop", "escape", "keep")
PRIVATE_USE = range(0xE000, 0xF900)
"""Characters no tokenizer gives meaning to: the placeholders of escaped strings."""


def special_strings(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Every string the tokenizer reads as a control token (end of turn, eos, pad, mask, any
    added special token), longest first so that a match is never a shorter token's."""
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(special | set(tokenizer.all_special_tokens), key=lambda s: (-len(s), s))


def texts(value) -> Iterator[str]:
    """Every string inside a conversation (messages, tool calls, tool schemas)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from texts(item)


def _mapped(value, f: Callable[[str], str]):
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {key: _mapped(item, f) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_mapped(item, f) for item in value]
    return value


@dataclass(frozen=True)
class Escaped:
    """A chat whose special-token strings are placeholders, and how to put them back."""

    chat: dict
    placeholders: tuple[tuple[str, str], ...]
    """(placeholder run, the string it stands for), one per string the chat holds."""

    def restore(self, text: str) -> str:
        for run, string in self.placeholders:
            text = text.replace(run, string)
        return text

    def holds_placeholder(self, text: str) -> bool:
        return any(run[0] in text for run, _ in self.placeholders)


class ContentSpecials:
    """Finds and escapes a tokenizer's special-token strings in conversations."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        strings = special_strings(tokenizer)
        self.pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def held(self, chat: dict) -> bool:
        """Whether any text of the chat holds a special-token string."""
        return self.pattern is not None and any(map(self.pattern.search, texts(chat)))

    def escaped(self, chat: dict) -> Escaped:
        """``chat`` with each special-token string replaced by a same-length run of a
        private-use character that the chat does not hold."""
        present = {m.group() for text in texts(chat) for m in self.pattern.finditer(text)}
        used = set().union(*map(set, texts(chat)))
        free = (chr(c) for c in PRIVATE_USE if chr(c) not in used)
        runs = {string: next(free) * len(string) for string in sorted(present)}
        chat = _mapped(chat, lambda text: self.pattern.sub(lambda m: runs[m.group()], text))
        return Escaped(chat, tuple((run, string) for string, run in runs.items()))


@dataclass(frozen=True)
class Encoding:
    """Token ids and character offsets, as the fast tokenizer's encodings give them."""

    ids: list[int]
    offsets: list[tuple[int, int]]


def encode_escaped(tokenizer: PreTrainedTokenizerFast, text: str, escaped: Escaped) -> Encoding:
    """Tokens of ``escaped.restore(text)`` with its escaped strings read as plain text and
    every other special token (the template's markup) as the control token it is."""
    backend = tokenizer.backend_tokenizer
    masked = backend.encode(text, add_special_tokens=False)
    added = tokenizer.added_tokens_decoder
    out = Encoding([], [])
    stretch: list[tuple[int, tuple[int, int]]] = []
    start = 0
    for token, span in zip(masked.ids, masked.offsets, strict=True):
        if token in added:
            _append_stretch(backend, text[start : span[0]], start, stretch, escaped, out)
            out.ids.append(token)
            out.offsets.append(span)
            start, stretch = span[1], []
        else:
            stretch.append((token, span))
    _append_stretch(backend, text[start:], start, stretch, escaped, out)
    return out


def _append_stretch(backend, piece: str, start: int, tokens, escaped: Escaped, out) -> None:
    """Append the tokens of ``piece``, the text between two added tokens from ``start``:
    as encoded when it holds no escaped string, else encoded again from the real text."""
    if not escaped.holds_placeholder(piece):
        out.ids.extend(token for token, _ in tokens)
        out.offsets.extend(span for _, span in tokens)
        return
    before, backend.encode_special_tokens = backend.encode_special_tokens, True
    try:
        plain = backend.encode(escaped.restore(piece), add_special_tokens=False)
    finally:
        backend.encode_special_tokens = before
    out.ids.extend(plain.ids)
    out.offsets.extend((start + begin, start + end) for begin, end in plain.offsets)
