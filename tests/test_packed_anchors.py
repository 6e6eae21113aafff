"""Anchors of packed rows: every block of slots stays inside the document its anchor is in."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.train.batches import build_micro_batch

documents = st.lists(st.booleans(), min_size=1, max_size=12)
"""One document's loss mask; its length is the document's."""
rows = st.lists(st.lists(documents, min_size=1, max_size=6), min_size=1, max_size=3)


class MaskStore:
    """Sample ``i``: tokens ``i + 1`` under the loss mask drawn for it."""

    def __init__(self, masks: list[list[bool]]) -> None:
        self.masks = masks

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        mask = np.array(self.masks[i], dtype=np.uint8)
        return np.full(len(mask), i + 1, dtype=np.int64), mask


def packed(layout: list[list[list[bool]]]) -> tuple[MaskStore, list[list[tuple]]]:
    """The store and plan rows of ``layout``: each row's documents back to back from 0."""
    masks, plan = [], []
    for row in layout:
        offset, entries = 0, []
        for mask in row:
            entries.append((len(masks), offset, len(mask)))
            masks.append(mask)
            offset += len(mask)
        plan.append(entries)
    return MaskStore(masks), plan


def candidates(mask: list[bool], block_size: int) -> int:
    """Anchor places of one document, counted by hand: a loss token with a whole block after
    it (itself included) before the document ends."""
    return sum(m and p + block_size <= len(mask) for p, m in enumerate(mask))


@settings(max_examples=60, deadline=None)
@given(layout=rows, block_size=st.integers(2, 5), count=st.integers(1, 6), epoch=st.integers(0, 3))
def test_no_anchor_block_spans_two_documents(layout, block_size, count, epoch):
    store, plan = packed(layout)
    mb = build_micro_batch(
        store, plan, block_size=block_size, anchors_per_sequence=count, gamma=7.0, seed=0,
        epoch=epoch,
    )  # fmt: skip
    docs, loss_mask = mb.document_ids.numpy(), mb.loss_mask.numpy()
    width = docs.shape[1]
    for r, entries in enumerate(plan):
        anchors = mb.anchors[r].numpy()
        real = anchors[anchors >= 0]
        assert (anchors[len(real) :] == -1).all(), "padding only after the row's anchors"
        assert len(set(real.tolist())) == len(real)
        for a in real:
            block = docs[r, a : a + block_size]
            assert a + block_size <= width and (block == docs[r, a]).all() and block[0] >= 0
            assert loss_mask[r, a]
        for doc, (sample, offset, length) in enumerate(entries):
            inside = real[(real >= offset) & (real < offset + length)]
            want = min(count, candidates(store.masks[sample], block_size))
            assert len(inside) == want, f"document {doc} of row {r}"
