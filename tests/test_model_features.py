"""Target features: only the fused layers are kept, the stack stops early, results unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.features.target_forward import decoder_layers, target_features
from dflash.model import document_layout
from dflash.model.document_layout import (
    DocumentLayout,
    document_classes,
    one_document_per_row,
    tile_keys,
)
from dflash.model.shipped import select_features
from dflash.model.target_attention import NAME

LAYERS = [1, 3]
TINY_TARGET = {"num_hidden_layers": 6}
"""The module's ``target`` (conftest.py): :func:`tiny_qwen3` of these keywords."""


def reference_features(target, ids, pos, docs, layer_ids):
    """The former computation: every hidden state of the whole model, an fp32 additive mask."""
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal & (docs[:, :, None] == docs[:, None, :])
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = target(
            input_ids=ids,
            position_ids=pos,
            attention_mask=additive[:, None],
            output_hidden_states=True,
            use_cache=False,
        )
    return select_features(out.hidden_states, layer_ids) * (docs >= 0)[..., None]


def padded_rows():
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24).repeat(2, 1)
    docs = torch.zeros(2, 24, dtype=torch.long)
    docs[1, 17:] = -1
    return ids, pos, docs


def packed_rows():
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 9 + [1] * 10 + [2] * 5, [0] * 14 + [1] * 6 + [-1] * 4])
    pos = torch.cat([torch.arange(9), torch.arange(10), torch.arange(5)]).repeat(2, 1)
    pos[1] = torch.cat([torch.arange(14), torch.arange(6), torch.arange(4)])
    return ids, pos, docs


def equal_rows():
    """Packed rows whose documents of one length lie back to back, as ``packed`` lays them."""
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    lengths = ([8, 8, 8], [6, 6, 5, 5, 2])
    docs = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(r)]) for r in lengths])
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in lengths])
    return ids, pos, docs


@pytest.mark.parametrize("step", [64, 4, 1], ids=["step64", "step4-classes", "step1-exact-classes"])
@pytest.mark.parametrize("rows", [padded_rows, packed_rows, equal_rows])
def test_same_features_as_the_whole_stack(target, rows, step, monkeypatch):
    monkeypatch.setattr(document_layout, "LENGTH_STEP", step)  # 4: several length classes
    ids, pos, docs = rows()
    got = target_features(target, ids, pos, docs, LAYERS)
    want = reference_features(target, ids, pos, docs, LAYERS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_above_the_deepest_fused_one_and_the_lm_head_never_run(target):
    ran = []
    layers = decoder_layers(target)
    hooks_before = [len(layer._forward_hooks) for layer in layers]
    modules = {f"layer{i}": layer for i, layer in enumerate(layers)} | {"lm_head": target.lm_head}
    handles = [
        m.register_forward_hook(lambda m, a, o, name=name: ran.append(name))
        for name, m in modules.items()
    ]
    try:
        target_features(target, *padded_rows(), LAYERS)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == ["layer0", "layer1", "layer2", "layer3"]
    assert [len(layer._forward_hooks) for layer in layers] == hooks_before  # ours are removed


def test_rows_of_one_document_need_no_mask(target, monkeypatch):
    """Padded rows included: positions restarting on the padding would make Hugging Face
    read the rows as packed and build a dense ``[R, 1, T, T]`` mask."""
    assert one_document_per_row(padded_rows()[2])
    assert not one_document_per_row(packed_rows()[2])
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids, pos, docs = padded_rows()
    pos[1, 17:] = 0  # as the data loader pads
    target_features(target, ids, pos, docs, LAYERS)
    assert masks == [None] * (max(LAYERS) + 1)


def dense_rule(docs: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[R, T, T]``: query i sees key j in its own run of ids, j <= i, within the window."""
    T = docs.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)
    starts = DocumentLayout.of(docs).starts
    allowed = (starts[:, :, None] == starts[:, None, :]) & (j <= i)
    return allowed & (j > i - window) if window is not None else allowed


@pytest.mark.parametrize("window", [None, 3, 11])
@pytest.mark.parametrize("tile", [4, 5, 24])
def test_tiles_gather_exactly_the_keys_each_query_may_see(window, tile):
    docs = torch.cat([packed_rows()[2], torch.tensor([[0, 0, -1, 1, -1] + [2] * 19])])
    R, T = docs.shape
    classes = tile_keys(DocumentLayout.of(docs).starts, window, tile)
    n = -(-T // tile)
    placed = torch.cat([tiles.index for tiles in classes])
    assert torch.equal(placed.sort().values, torch.arange(R * n))  # every tile in one class
    seen = torch.zeros(R, n * tile, R * T, dtype=torch.long)
    for tiles in classes:
        for j, t in enumerate(tiles.index.tolist()):
            r, first = divmod(t, n)
            rows = slice(first * tile, (first + 1) * tile)
            seen[r, rows].index_put_(
                (torch.arange(tile)[:, None], tiles.keys[j].expand(tile, -1)),
                tiles.mask[j, 0].long(),
                accumulate=True,
            )
        assert tiles.mask.any(dim=-1).all()  # no query sees nothing
    want = torch.zeros(R, T, R * T, dtype=torch.long)
    for r in range(R):
        want[r, :, r * T : (r + 1) * T] = dense_rule(docs[r : r + 1], window)[0].long()
    assert torch.equal(seen[:, :T], want)  # every visible key once, and nothing else
    *narrow, widest = sorted(tiles.keys.shape[1] for tiles in classes)
    assert all(w in {tile * 2**k for k in range(8)} for w in narrow) and widest <= T


@pytest.mark.parametrize("step", [1, 4, 64])
def test_length_classes_hold_every_document_once(step):
    more = [[0, 0, -1, 1, -1] + [2] * 19, [0] * 8 + [1] * 8 + [2] * 8]
    docs = torch.cat([packed_rows()[2], equal_rows()[2][1:], torch.tensor(more)])
    layout = DocumentLayout.of(docs)
    lengths = [9, 10, 5, 14, 6, 6, 6, 5, 5, 2, 2, 1, 19, 8, 8, 8]
    assert layout.length.tolist() == lengths  # padding runs left out
    size = docs.numel()
    written = torch.zeros(size + 1, dtype=torch.long)
    classes = document_classes(layout.begin, layout.length, size, step)
    for c in classes:
        assert c.source.numel() == c.target.numel() == c.count * c.width
        source, target = c.source.view(c.count, c.width), c.target.view(c.count, c.width)
        inside = target < size
        if c.span is not None:  # back to back, one length: read and written in place
            assert inside.all() and torch.equal(source.flatten(), torch.arange(size)[c.span])
        else:
            assert c.width % step == 0
        assert torch.equal(source[inside], target[inside])  # a document reads where it writes
        assert (inside.sum(1) > c.width - step).all()  # padded by less than one step
        assert torch.equal(inside, inside.cummin(dim=1).values)  # its tokens first, in order
        written.index_add_(0, target.flatten(), torch.ones_like(target.flatten()))
    assert torch.equal(written[:size], (docs >= 0).flatten().long())  # every real token once
    in_place = sorted((c.count, c.width) for c in classes if c.span is not None)
    # Exact classes: the lone documents, the back-to-back 8s and the two 2s (the second opens
    # the next row, so they lie back to back flattened); not the 6s and 5s, whose equals lie
    # elsewhere. Rounded to 4: the lone 14 and 19 only.
    want = {1: [(1, 1), (1, 9), (1, 10), (1, 14), (1, 19), (2, 2), (3, 8)]}
    want |= {4: [(1, 14), (1, 19)], 64: []}
    assert in_place == want[step]


def test_packed_rows_put_the_attention_kernel_back(target):
    before = target.config._attn_implementation
    ran = []
    handle = decoder_layers(target)[0].self_attn.register_forward_hook(
        lambda m, a, o: ran.append(m.config._attn_implementation)
    )
    try:
        target_features(target, *packed_rows(), LAYERS)
    finally:
        handle.remove()
    assert ran == [NAME] and target.config._attn_implementation == before


def test_a_packed_row_costs_one_attention_call_per_layer(target, monkeypatch):
    """However many documents a row holds: no loop over documents, one kernel call per layer
    and width class (one class here: every tile needs the same few keys)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    ids, pos, _ = packed_rows()
    docs = torch.arange(24).div(3, rounding_mode="floor").repeat(2, 1)  # 8 documents a row
    target_features(target, ids, pos, docs, LAYERS)
    assert len(calls) == max(LAYERS) + 1
