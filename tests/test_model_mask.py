"""The block attention mask: one test per rule, the FlexAttention twin, and finite outputs."""

import pytest
import torch
from conftest import tiny_qwen3

from dflash.model.drafter import DFlashDrafter
from dflash.model.drafter_attention import block_mask_mod, build_block_mask, dense_attention

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


def _pairs_of(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """A ``BlockMask`` applied pair by pair ``[B, Q, KV]``: full tiles all True, partial tiles
    through its ``mask_mod``, the rest False."""
    from torch.nn.attention.flex_attention import create_mask

    tile_q, tile_kv = block_mask.BLOCK_SIZE

    def tiles(num, indices):
        n_q, n_kv = indices.shape[-2], -(-kv_len // tile_kv)
        dense = torch.zeros(indices.shape[0], n_q, n_kv + indices.shape[-1], dtype=torch.bool)
        listed = torch.arange(indices.shape[-1]) < num[:, 0, :, None]
        at = torch.where(listed, indices[:, 0].long(), n_kv)
        dense.scatter_(2, at, True)
        dense = dense[..., :n_kv].repeat_interleave(tile_q, 1).repeat_interleave(tile_kv, 2)
        return dense[:, :q_len, :kv_len]

    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    B = block_mask.kv_num_blocks.shape[0]
    pairs = create_mask(block_mask.mask_mod, B, None, q_len, kv_len, device="cpu")[:, 0]
    assert not (full & partial).any()
    return full | (partial & pairs)


def _layouts(gen: torch.Generator):
    """Rows of ``T`` positions: padded rows, packed rows of several documents, ragged ends."""
    for T, bs, n_anchors in ((300, 16, 24), (257, 16, 9), (131, 7, 40), (400, 3, 50)):
        lengths = [
            [T - 37],  # one padded document
            [40, 1, 90, T - 131],  # packed, one document of a single token
            [T],  # one document filling the row
        ]
        docs = torch.full((len(lengths), T), -1)
        for r, row in enumerate(lengths):
            docs[r, : sum(row)] = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
        anchors = torch.randint(0, T - 1, (len(lengths), n_anchors), generator=gen)
        anchors = anchors.sort(dim=1).values
        anchors[0, -5:] = -1  # padded anchor slots
        anchors[0, 0] = T - 10  # an anchor on padding: it sees only its own block
        yield T, bs, anchors, docs


def test_flex_mask_from_tiles_matches_the_dense_rule_pair_by_pair():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from dflash.model.drafter_attention import flex_block_mask

    gen = torch.Generator().manual_seed(0)
    for T, bs, anchors, docs in _layouts(gen):
        q_len, kv_len = anchors.shape[1] * bs, T + anchors.shape[1] * bs
        made = _pairs_of(flex_block_mask(anchors, docs, bs, T), q_len, kv_len)
        assert torch.equal(made, build_block_mask(anchors, docs, bs, T)), (T, bs)


def test_flex_mask_from_tiles_skips_and_fills_whole_tiles():
    """Tiles nobody sees are left out and wholly seen ones need no ``mask_mod``: one document of
    1024 tokens, 8 anchors a query tile, all at its end."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from dflash.model.drafter_attention import flex_block_mask

    T, bs = 1024, 16
    anchors = torch.arange(1000, 1016)[None]
    mask = flex_block_mask(anchors, torch.zeros(1, T, dtype=torch.long), bs, T)
    assert mask.full_kv_num_blocks.flatten().tolist() == [7, 7]  # keys 0..895
    assert mask.kv_num_blocks.flatten().tolist() == [2, 2]  # keys 896.., and its own blocks
