"""The free baseline a drafter must beat: n-gram prompt lookup.

Prompt lookup decoding (vLLM's ``ngram`` speculator) costs no model: it finds the longest
suffix of the text so far (up to ``max_n`` tokens) that occurred earlier, takes its most recent
earlier occurrence and proposes the tokens that followed it. A target that repeats itself, as a
tiny one does, hands this baseline long acceptances for free, so τ alone can flatter a drafter.
"""

from __future__ import annotations

from torch import Tensor


def ngram_lookup(history: list[int], max_n: int, count: int) -> list[int]:
    """Up to ``count`` tokens that followed the most recent earlier match of the longest suffix.

    Suffixes of ``max_n`` down to 1 tokens are tried in turn; an occurrence counts when it
    starts before the suffix itself. Returns ``[]`` when no suffix recurs.
    """
    length = len(history)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + count]
    return []


class NgramProposer:
    """Prompt lookup as a proposer for :func:`dflash.model.generate.speculative_generate`."""

    uses_features = False

    def __init__(self, block_size: int, max_n: int = 4) -> None:
        self.count, self.max_n = block_size - 1, max_n

    def start(self, hidden_states: tuple[Tensor, ...] | None, length: int) -> None:
        pass

    def propose(self, history: list[int], position: int) -> list[int]:
        return ngram_lookup(history, self.max_n, self.count)

    def commit(self, hidden_states: tuple[Tensor, ...] | None, position: int, count: int) -> None:
        pass
