"""The two-part training attention equals the dense-mask reference, values and gradients."""

import pytest
import torch

from dflash.model import drafter_attention as attention
from dflash.model.drafter_attention import (
    anchor_blocks,
    attend,
    build_attention_mask,
    build_block_mask,
    document_starts,
)

BS = 4
T = 40


@pytest.fixture(params=[True, False], ids=["fused", "math"])
def kernel(request, monkeypatch):
    """Both context kernels: torch's fused CPU flash attention and the plain-torch math."""
    monkeypatch.setattr(attention, "FUSED_ON_CPU", request.param)


def _rows(cuts: list[int], anchors: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``T`` tokens: documents start at ``cuts``, the last 3 positions are padding."""
    docs = torch.zeros(len(anchors), T, dtype=torch.long)
    for cut in cuts:
        docs[:, cut:] += 1
    docs[:, T - 3 :] = -1
    return torch.tensor(anchors), docs


def _qkv(rows: int, anchors: int, heads: int, kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int, length: int) -> torch.Tensor:
        return torch.randn(rows, n, length, 8, generator=gen).requires_grad_()

    context = (rand(kv_heads, T), rand(kv_heads, T))
    block = (rand(kv_heads, anchors * BS), rand(kv_heads, anchors * BS))
    return rand(heads, anchors * BS), context, block


def _compare(anchors: torch.Tensor, docs: torch.Tensor, heads: int = 4, kv_heads: int = 2):
    """Two-part output and every input gradient against the dense reference, fp32 within 1e-5."""
    q, context, block = _qkv(*anchors.shape, heads, kv_heads)
    inputs = (q, *context, *block)
    dense = build_block_mask(anchors, docs, BS, T)
    ref = attend(q, context, block, dense, scale=0.35)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out)
    blocks = anchor_blocks(anchors, docs, BS, T, budget=200)  # several chunks
    out = attend(q, context, block, blocks, scale=0.35)
    grads = torch.autograd.grad(out, inputs, grad_out)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return out


def test_padded_rows_match_the_dense_mask(kernel):
    anchors, docs = _rows([], [[0, 3, 9, 15, 22, 30, 36], [2, 5, 6, 20, 21, 33, -1]])
    _compare(anchors, docs)


def test_packed_rows_with_several_documents_match_the_dense_mask(kernel):
    anchors, docs = _rows(
        [11, 12, 25], [[1, 4, 11, 12, 14, 20, 26, 35], [0, 11, 13, 24, 25, 30, 31, 36]]
    )
    _compare(anchors, docs)


def test_blind_padded_blocks_give_zeros_and_finite_gradients(kernel):
    anchors, docs = _rows([20], [[5, 20, 27, -1, -1], [-1, -1, -1, -1, -1]])
    out = _compare(anchors, docs, heads=2, kv_heads=2)
    assert torch.equal(out[0, :, 3 * BS :], torch.zeros_like(out[0, :, 3 * BS :]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_unsorted_anchors_and_grouped_heads(kernel):
    anchors, docs = _rows([18], [[30, 2, 19, 7, 25, 0]])
    _compare(anchors, docs, heads=6, kv_heads=1)


def test_chunks_cut_the_context_window():
    anchors, docs = _rows([11, 25], [[1, 4, 8, 26, 30, 33]])
    chunks = anchor_blocks(anchors, docs, BS, T, budget=100).chunks
    assert [c.positions[0].tolist() for c in chunks] == [list(range(8)), list(range(25, 33))]
    assert document_starts(docs)[0, [0, 10, 11, 24, 25, 39]].tolist() == [0, 0, 11, 11, 25, 37]


def test_chunks_stay_within_the_score_budget():
    """No score matrix for all anchors at once: each chunk holds at most ``budget`` scores per
    head, unless a single anchor needs more."""
    anchors, docs = _rows([11, 25], [[1, 4, 8, 12, 20, 26, 30, 33], [0, 2, 5, 9, 13, 27, 29, -1]])
    for budget in (50, 300, 3000):
        chunks = anchor_blocks(anchors, docs, BS, T, budget=budget).chunks
        assert sum(c.stop - c.start for c in chunks) <= anchors.shape[1]
        for c in chunks:
            n = c.stop - c.start
            assert n == 1 or 2 * n * BS * c.positions.shape[1] <= budget


def test_no_chunk_when_no_anchor_has_context(kernel):
    anchors, docs = _rows([11], [[0, 11, -1]])
    assert anchor_blocks(anchors, docs, BS, T, budget=1 << 20).chunks == ()
    _compare(anchors, docs)


@pytest.mark.slow
def test_flex_attention_on_cpu_matches_the_dense_mask():
    """Forward only: torch 2.13 compiles FlexAttention's forward on CPU (minutes), but raises
    "FlexAttention does not support backward on CPU"; gradients are checked on CUDA by
    bench/gpu_check_model.py."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    anchors, docs = _rows([11, 25], [[1, 4, 11, 14, 26, 30], [0, 3, 20, 25, -1, -1]])
    q, context, block = _qkv(*anchors.shape, 4, 2)
    q, context, block = q.detach(), [t.detach() for t in context], [t.detach() for t in block]
    with torch.no_grad():
        flex = build_attention_mask(anchors, docs, BS, T, flex=True)
        out = attend(q, context, block, flex, scale=0.35)
        ref = attend(q, context, block, build_block_mask(anchors, docs, BS, T), scale=0.35)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_six_micro_batch_shapes_compile_at_most_twice(monkeypatch):
    """Lengths are symbolic and padded to whole tiles, so the one recompile left is for one row
    against several (torch specialises a size of 1). Forward only, traced by ``aot_eager``:
    torch 2.13's CPU FlexAttention kernel neither builds with symbolic lengths nor has a
    backward, and the guards that force recompiles are the tracer's."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setitem(attention.COMPILE_OPTIONS, "cpu", {"dynamic": True, "backend": "aot_eager"})
    attention._compiled_flex_attention.cache_clear()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    before = attention.flex_compiles()
    try:
        for rows, length, n_anchors in ((1, 40, 6), (2, 56, 9), (1, 96, 20), (3, 72, 11),
                                        (2, 130, 33), (1, 200, 40)):  # fmt: skip
            docs = (torch.arange(length) >= length // 2).long().repeat(rows, 1)
            anchors = torch.randint(1, length - 1, (rows, n_anchors), generator=gen)
            anchors = anchors.sort(dim=1).values
            anchors[0, -1] = -1

            q = torch.randn(rows, 4, n_anchors * BS, 8, generator=gen)
            block = torch.randn(2, rows, 2, n_anchors * BS, 8, generator=gen).unbind()
            context = torch.randn(2, rows, 2, length, 8, generator=gen).unbind()
            with torch.no_grad():
                mask = build_attention_mask(anchors, docs, BS, length, flex=True)
                out = attend(q, context, block, mask, scale=0.35)
                ref = attend(q, context, block, build_block_mask(anchors, docs, BS, length), 0.35)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert attention.flex_compiles() - before <= 2
    finally:
        attention._compiled_flex_attention.cache_clear()
