"""Does an answer end in a loop? A tiny target's greedy answers often repeat a phrase until
the token cap, which any drafter (and n-gram lookup) predicts for free."""

from __future__ import annotations

from collections.abc import Sequence

MAX_PERIOD = 16
MIN_TAIL = 8


def ends_in_loop(items: Sequence, max_period: int = MAX_PERIOD, min_tail: int = MIN_TAIL) -> bool:
    """True when the last ``max(2p, min_tail)`` items repeat with some period ``p <= max_period``.

    Items are tokens or words. Two full repeats of a phrase, or ``min_tail`` items of a short
    one ("no no no ..."), count as a loop.
    """
    items = list(items)
    for period in range(1, max_period + 1):
        tail = max(2 * period, min_tail)
        if tail > len(items):
            break
        window = items[-tail:]
        if all(window[i] == window[i - period] for i in range(period, tail)):
            return True
    return False


def text_ends_in_loop(text: str) -> bool:
    """A repeating tail of words, or of characters (``"\\n\\n\\n..."``, ``"IIII..."``)."""
    return ends_in_loop(text.split()) or ends_in_loop(text)
