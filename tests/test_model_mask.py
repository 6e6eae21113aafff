"""The block attention mask: one test per rule, the FlexAttention twin, and finite outputs."""

import pytest
import torch
from conftest import tiny_qwen3

from dflash.model.attention import block_mask_mod, build_block_mask, dense_attention
from dflash.model.drafter import DFlashDrafter

BS = 3
T = 10


def mask_for(anchors: list[int], document_ids: list[int] | None = None) -> torch.Tensor:
    """Mask of one row of ``T`` context positions, ``[len(anchors)*BS, T + len(anchors)*BS]``."""
    docs = torch.tensor([document_ids or [0] * T])
    return build_block_mask(torch.tensor([anchors]), docs, BS, T)[0]


def test_bidirectional_inside_a_block():
    m = mask_for([4, 7])
    for q in range(BS):
        assert m[q, T : T + BS].all()  # slot q sees every slot of its own block, later ones too
        assert m[BS + q, T + BS : T + 2 * BS].all()


def test_context_strictly_before_the_anchor():
    m = mask_for([4, 7])
    assert m[:BS, :4].all() and not m[:BS, 4:T].any()  # anchor 4 sees 0..3, not itself
    assert m[BS:, :7].all() and not m[BS:, 7:T].any()


def test_nothing_across_blocks():
    m = mask_for([4, 7])
    assert not m[:BS, T + BS :].any()
    assert not m[BS:, T : T + BS].any()


def test_padded_blocks_see_nothing():
    m = mask_for([4, -1])
    assert not m[BS:].any()
    assert not m[:BS, T + BS :].any()  # and nobody sees them


def test_nothing_across_documents():
    docs = [0, 0, 0, 0, 1, 1, 1, 1, 1, -1]
    m = mask_for([1, 6], docs)
    assert m[:BS, :1].all() and not m[:BS, 1:T].any()
    assert not m[BS:, :4].any()  # document 1 never sees document 0
    assert m[BS:, 4:6].all() and not m[BS:, 6:T].any()


def test_first_anchor_of_a_document_sees_only_its_block():
    docs = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    m = mask_for([3], docs)
    assert not m[:, :T].any() and m[:, T:].all()


def test_flex_mask_mod_matches_dense_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # random packed rows: documents, padding and missing anchors
        cuts = torch.randint(0, 2, (2, T), generator=gen).cumsum(1) // 3
        docs = torch.where(torch.arange(T) < T - 2, cuts, -1)
        anchors = torch.randint(-1, T - 2, (2, 4), generator=gen)
        dense = build_block_mask(anchors, docs, BS, T)
        mod = block_mask_mod(anchors, docs, BS, T)
        made = flex.create_mask(mod, 2, None, 4 * BS, T + 4 * BS, device="cpu")[:, 0]
        assert torch.equal(made, dense)


def test_blind_queries_give_zeros_and_finite_gradients():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 1, 6, 8, requires_grad=True)
    v = torch.randn(1, 1, 6, 8, requires_grad=True)
    mask = torch.zeros(1, 4, 6, dtype=torch.bool)
    mask[0, :2, :3] = True
    out = dense_attention(q, k, v, mask, scale=8**-0.5)
    assert torch.equal(out[0, :, 2:], torch.zeros(2, 2, 8))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_drafter_ignores_context_at_and_after_the_anchor():
    """Behavioural check of the strict ``<``: features at the anchor must not leak."""
    target = tiny_qwen3(vocab_size=64, num_hidden_layers=5)
    drafter = DFlashDrafter.from_target(
        target, block_size=BS, num_hidden_layers=2, num_target_features=2, mask_token_id=63
    )
    anchors = torch.tensor([[5]])
    docs = torch.zeros(1, T, dtype=torch.long)
    mask = build_block_mask(anchors, docs, BS, T)
    block = torch.tensor([[7, 63, 63]])
    features = torch.randn(1, T, 64)
    positions = torch.arange(T)[None]

    def run(f):
        return drafter(block, torch.tensor([[5, 6, 7]]), f, positions, mask)

    base = run(features)
    later = features.clone()
    later[:, 5:] = torch.randn(1, T - 5, 64)
    assert torch.equal(run(later), base)
    earlier = features.clone()
    earlier[:, 4] += 1.0
    assert not torch.allclose(run(earlier), base)
