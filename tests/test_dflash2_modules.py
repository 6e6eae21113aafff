"""DFlash 2's conv and selector against references written straight from their formulas.

The conv mixes slot t with slots t-1.. of its own block only, through ``base + projection(u_t)``
per channel group; the selector scores ``U(b) + <A(a) * P(h), B(b)>`` over U's top-K and walks
the block greedily from the anchor. Tiny sizes, fp64 where values are compared.
"""

import pytest
import torch
from conftest import BLOCK_SIZE, MASK_ID, tiny_drafter
from torch import nn

from dflash.model import dflash2
from dflash.model.dflash2 import (
    CandidateSelector,
    DFlash2Layer,
    GroupedDynamicCausalConv,
    draft_value,
    init_dflash2_,
    teacher_predecessors,
    unary,
)
from dflash.model.drafter import TrainingAttention
from dflash.model.drafter_attention import build_attention_mask, build_block_mask
from dflash.model.shipped import Layer, rope

H, GS = 12, 4
V, RANK, K = 40, 6, 5
MULTIPLIER, SOFTCAP = 0.7, 3.0


def _randomize_(module: nn.Module, draw: int = 0) -> nn.Module:
    """Every parameter drawn anew, so no term of a formula hides behind a zero init."""
    gen = torch.Generator().manual_seed(draw)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


def _conv(taps: int = 2, block_size: int = 4) -> GroupedDynamicCausalConv:
    return _randomize_(GroupedDynamicCausalConv(H, block_size, taps, GS).double())


def _reference_conv(conv: GroupedDynamicCausalConv, u: torch.Tensor, side: int, x: torch.Tensor):
    """Block by block, slot by slot, channel by channel: ``sum_j (base[side, j, c] +
    D_t[side*T*G + j*G + c // gs]) * x_{t-j}[c]`` over the taps inside the block."""
    bs, taps, groups = conv.block_size, conv.kernel_size, H // GS
    weight, base = conv.kernel_projection.weight, conv.base_kernel
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], bs):
            for t in range(min(bs, x.shape[1] - start)):
                d = weight @ u[row, start + t]
                for c in range(H):
                    for j in range(min(taps, t + 1)):
                        k = base[side, j, c] + d[side * taps * groups + j * groups + c // GS]
                        out[row, start + t, c] += k * x[row, start + t - j, c]
    return out


@pytest.mark.parametrize("taps", [2, 3])
@pytest.mark.parametrize("length", [12, 14, 3], ids=["3-blocks", "short-last", "one-short"])
def test_conv_is_the_formula_block_by_block(taps, length):
    conv = _conv(taps)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(2, length, H, generator=gen, dtype=torch.float64)
    w = torch.randn(2, length, H, generator=gen, dtype=torch.float64)
    v, dynamic = conv.prepare(u)
    torch.testing.assert_close(v, _reference_conv(conv, u, 0, u), atol=1e-10, rtol=0)
    y = conv.finish(w, dynamic)
    torch.testing.assert_close(y, _reference_conv(conv, u, 1, w), atol=1e-10, rtol=0)


def _saved_bytes_and_grads(convolve, x, dynamic, base):
    """What ``convolve`` keeps for backward (bytes), and its inputs' gradients."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = convolve(x, dynamic, base, 4, GS)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (x, dynamic, base)]
    for t in (x, dynamic, base):
        t.grad = None
    return sum(saved), grads


def test_the_conv_keeps_its_inputs_alone_and_recomputes_the_same_gradients():
    """Under autograd the taps are recomputed in backward: kept, each tap's shifted input and
    kernel would be two more copies of ``x`` per tap (the largest activation of a DFlash 2
    step at scale, bench/memory_model.py); the gradients are bit for bit those of the kept ones."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, H, generator=gen).requires_grad_()
    dynamic = torch.randn(2, 16, 3, H // GS, generator=gen).requires_grad_()
    base = torch.randn(3, H, generator=gen).requires_grad_()
    kept, direct = _saved_bytes_and_grads(dflash2._convolve, x, dynamic, base)
    recomputed, grads = _saved_bytes_and_grads(dflash2.block_convolve, x, dynamic, base)
    inputs = sum(t.numel() * t.element_size() for t in (x, dynamic, base))
    assert recomputed <= inputs < kept / 2
    for a, b in zip(direct, grads, strict=True):
        assert torch.equal(a, b)


def test_conv_never_mixes_across_a_block_boundary():
    """Slot 0 of block 1 reaches no slot of block 0, and block 0's last slot none of block 1;
    inside a block, a slot does reach the one after it."""
    conv = _conv(taps=3)
    u = torch.randn(1, 12, H, dtype=torch.float64)
    base, _ = conv.prepare(u)
    for slot, same, other in [(4, slice(4, 8), slice(0, 4)), (3, slice(0, 4), slice(4, 12))]:
        moved = u.clone()
        moved[0, slot] += 1.0
        out, _ = conv.prepare(moved)
        assert torch.equal(out[:, other], base[:, other])
        assert not torch.equal(out[:, same], base[:, same])
    moved = u.clone()
    moved[0, 5] += 1.0
    assert not torch.equal(conv.prepare(moved)[0][:, 6], base[:, 6])


def test_fresh_conv_is_the_exact_identity():
    conv = GroupedDynamicCausalConv(H, 4, 2, GS)
    u, w = torch.randn(2, 8, H), torch.randn(2, 8, H)
    v, dynamic = conv.prepare(u)
    assert torch.equal(v, u)
    assert torch.equal(conv.finish(w, dynamic), w)
    _randomize_(conv)
    init_dflash2_(conv, std=0.02)
    assert torch.equal(conv.prepare(u)[0], u)


def test_weights_carry_the_names_and_shapes_engines_load(drafter):
    config = _dflash2_config(drafter.config, taps=2, group=8)
    layer = DFlash2Layer(config, 0)
    shapes = {name: tuple(p.shape) for name, p in layer.state_dict().items()}
    hidden = config.hidden_size
    for conv in ("attention_conv", "mlp_conv"):
        assert shapes[f"{conv}.base_kernel"] == (2, 2, hidden)
        assert shapes[f"{conv}.kernel_projection.weight"] == (2 * 2 * hidden // 8, hidden)
    selector = CandidateSelector.from_config(_dflash2_config(drafter.config, rank=RANK, top_k=K))
    assert {name: tuple(p.shape) for name, p in selector.state_dict().items()} == {
        "hidden_projection.weight": (RANK, hidden),
        "predecessor_codebook": (config.vocab_size, RANK),
        "successor_codebook": (config.vocab_size, RANK),
    }


def test_a_config_without_conv_sizes_is_refused(drafter):
    with pytest.raises(ValueError, match="conv_group_size"):
        DFlash2Layer(_dflash2_config(drafter.config, taps=2), 0)
    with pytest.raises(ValueError, match="does not divide"):
        GroupedDynamicCausalConv(H, 4, 2, 5)
    with pytest.raises(ValueError, match="conv_kernel_size 5"):
        GroupedDynamicCausalConv(H, 4, 5, GS)


def _dflash2_config(config, taps=None, group=None, rank=None, top_k=None):
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    extra = {n: v for n, v in zip(names, (taps, group, rank, top_k), strict=True) if v}
    copy = type(config).from_dict(config.to_dict())
    copy.dflash_config = {**config.dflash, **extra}
    return copy


class TrainingDFlash2Layer(DFlash2Layer):
    attention = TrainingAttention


def _dflash2_drafter(target, drafter):
    """The ``drafter`` fixture's twin with DFlash 2 layers: the same weights, identity convs."""
    twin = tiny_drafter(target)
    config = _dflash2_config(drafter.config, taps=2, group=8)
    twin.layers = nn.ModuleList(
        TrainingDFlash2Layer(config, i) for i in range(config.num_hidden_layers)
    )
    missing, unexpected = twin.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("_conv." in name for name in missing)
    return twin


def _packed_rows(drafter, anchors, mask_kind):
    """Hidden states ``[A, bs, H]`` of one packed row of two documents, blocks at ``anchors``."""
    gen = torch.Generator().manual_seed(3)
    T = 20
    ids = torch.randint(0, MASK_ID, (1, T), generator=gen)
    docs = torch.tensor([[0] * 11 + [1] * 9])
    pos = torch.cat([torch.arange(11), torch.arange(9)])[None]
    width = drafter.fc.weight.shape[1]
    features = torch.randn(1, T, width, generator=gen, dtype=drafter.fc.weight.dtype)
    slot = torch.arange(BLOCK_SIZE)
    block_ids = torch.where(slot == 0, ids[0, anchors][:, None], MASK_ID).flatten()[None]
    block_pos = (pos[0, anchors][:, None] + slot).flatten()[None]
    mask = mask_kind(anchors[None], docs, BLOCK_SIZE, T)
    hidden = drafter(block_ids, block_pos, features, pos, mask)
    return hidden.view(len(anchors), BLOCK_SIZE, -1)


@torch.no_grad()
def test_dflash2_layers_start_as_dflash_and_keep_blocks_apart(target, drafter):
    """Identity convs: the DFlash 2 drafter computes the DFlash one's hidden states exactly; with
    trained convs, every block of a packed row (the training kernel) is what it is alone."""
    twin = _dflash2_drafter(target, drafter)
    anchors = torch.tensor([2, 5, 12, 15])
    assert torch.equal(
        _packed_rows(twin, anchors, build_attention_mask),
        _packed_rows(drafter, anchors, build_attention_mask),
    )
    for layer in twin.layers:
        _randomize_(layer.attention_conv, draw=layer.self_attn.layer)
        _randomize_(layer.mlp_conv, draw=layer.self_attn.layer + 7)
    packed = _packed_rows(twin, anchors, build_attention_mask)
    assert not torch.allclose(packed, _packed_rows(drafter, anchors, build_attention_mask))
    for a in range(len(anchors)):
        alone = _packed_rows(twin, anchors[a : a + 1], build_block_mask)
        torch.testing.assert_close(packed[a], alone[0], atol=1e-5, rtol=1e-5)


def test_dflash2_layer_wraps_the_sublayers_as_written(drafter):
    """x + finish(attn(prepare(norm x))), then the same around the MLP: against a layer of the
    same weights whose sublayers are called by hand."""
    config = _dflash2_config(drafter.config, taps=2, group=8)
    layer = _randomize_(DFlash2Layer(config, 0).double())
    plain = Layer(config, 0).double()
    plain.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(1, 8, config.hidden_size, dtype=torch.float64)
    context = torch.randn(1, 5, config.hidden_size, dtype=torch.float64)
    positions = torch.arange(13)[None]
    cos, sin = (t.double() for t in rope(positions, config.head_dim, config.theta))
    args = (context, cos, sin, positions)
    v, d = layer.attention_conv.prepare(plain.input_layernorm(x))
    mid = x + layer.attention_conv.finish(plain.self_attn(v, *args), d)
    v, d = layer.mlp_conv.prepare(plain.post_attention_layernorm(mid))
    want = mid + layer.mlp_conv.finish(plain.mlp(v), d)
    torch.testing.assert_close(layer(x, *args), want, atol=1e-12, rtol=0)
    assert not torch.allclose(plain(x, *args), want)


# The selector


def _selector(pair: bool = True) -> CandidateSelector:
    selector = CandidateSelector(V, H, RANK, K).double()
    return _randomize_(selector, draw=5) if pair else selector


def _inputs(shape=(2, 6), draw: int = 2):
    gen = torch.Generator().manual_seed(draw)
    logits = torch.randn(*shape, V, generator=gen, dtype=torch.float64) * 3
    hidden = torch.randn(*shape, H, generator=gen, dtype=torch.float64)
    return logits, hidden, gen


def _reference_score(selector, logits, hidden, predecessor, candidate):
    """``U(b) + sum_r A[a, r] P(h)[r] B[b, r]`` for one slot and one candidate."""
    u = SOFTCAP * torch.tanh(MULTIPLIER * logits[candidate] / SOFTCAP)
    projected = selector.hidden_projection.weight @ hidden
    a, b = selector.predecessor_codebook[predecessor], selector.successor_codebook[candidate]
    return u + sum(a[r] * projected[r] * b[r] for r in range(RANK))


def test_teacher_forced_scores_are_the_formula():
    selector = _selector()
    logits, hidden, gen = _inputs()
    tokens = torch.randint(0, V, (2, 6), generator=gen)
    preds = teacher_predecessors(tokens, 3)
    out = selector.scores(logits, hidden, preds, output_multiplier=MULTIPLIER, softcap=SOFTCAP)
    assert torch.equal(out.candidates, logits.topk(K, dim=-1).indices)
    for row in range(2):
        for t in range(6):
            for k, b in enumerate(out.candidates[row, t].tolist()):
                want = _reference_score(selector, logits[row, t], hidden[row, t], preds[row, t], b)
                torch.testing.assert_close(out.scores[row, t, k], want, atol=1e-10, rtol=0)


def test_teacher_predecessors_restart_at_each_anchor():
    tokens = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 23]])
    assert teacher_predecessors(tokens, 4).tolist() == [[10, 10, 11, 12, 20, 20, 21, 22]]


def test_fresh_selector_scores_and_walks_by_the_unary_logits():
    selector = _selector(pair=False)
    logits, hidden, gen = _inputs()
    anchor = torch.randint(0, V, (2,), generator=gen)
    preds = torch.randint(0, V, (2, 6), generator=gen)
    out = selector.scores(logits, hidden, preds, output_multiplier=MULTIPLIER, softcap=SOFTCAP)
    top = logits.topk(K, dim=-1).values
    assert torch.equal(out.scores, unary(top, MULTIPLIER, SOFTCAP))
    walk = selector.walk(logits, hidden, anchor, output_multiplier=MULTIPLIER, softcap=SOFTCAP)
    assert torch.equal(walk.tokens, logits.argmax(dim=-1))
    assert torch.equal(walk.q.argmax(-1), torch.zeros(2, 6, dtype=torch.long))


def test_init_after_a_trainers_normal_init_restores_the_dflash_start():
    """A trainer draws every ``Linear`` from a normal; ``init_dflash2_`` then makes each conv the
    identity and each selector's pair term 0 again."""
    model = nn.ModuleDict({"conv": GroupedDynamicCausalConv(H, 4, 2, GS), "sel": _selector()})
    _randomize_(model)
    init_dflash2_(model, std=0.02)
    u = torch.randn(1, 8, H)
    assert torch.equal(model["conv"].prepare(u)[0], u)
    logits, hidden, gen = _inputs()
    preds = torch.randint(0, V, (2, 6), generator=gen)
    scores = model["sel"].scores(logits, hidden, preds).scores
    assert torch.equal(scores, logits.topk(K, dim=-1).values)


def test_the_walk_starts_from_the_anchor_and_follows_its_own_tokens():
    selector = _selector()
    logits, hidden, _ = _inputs()
    anchor = torch.tensor([3, 3])
    walk = selector.walk(logits, hidden, anchor, output_multiplier=MULTIPLIER, softcap=SOFTCAP)
    preds = torch.cat([anchor[:, None], walk.tokens[:, :-1]], dim=1)
    forced = selector.scores(logits, hidden, preds, output_multiplier=MULTIPLIER, softcap=SOFTCAP)
    torch.testing.assert_close(walk.scores, forced.scores, atol=1e-12, rtol=0)
    chosen = walk.candidates.gather(-1, walk.scores.argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(walk.tokens, chosen)
    assert not torch.equal(walk.tokens, logits.argmax(dim=-1))  # the pair term decides here
    other = selector.walk(logits, hidden, torch.tensor([4, 4]))
    assert not torch.allclose(other.scores[:, 0], walk.scores[:, 0])


def test_sampled_walk_draws_from_the_k_way_softmax_repeatably():
    selector = _selector()
    logits, hidden, _ = _inputs(shape=(3, 5))
    anchor = torch.tensor([1, 2, 3])

    def walk(draw: int):
        gen = torch.Generator().manual_seed(draw)
        return selector.walk(logits, hidden, anchor, temperature=0.7, generator=gen)

    first = walk(11)
    torch.testing.assert_close(first.q.sum(-1), torch.ones(3, 5, dtype=torch.float64))
    torch.testing.assert_close(first.q, torch.softmax(first.scores / 0.7, -1))
    assert (first.candidates == first.tokens[..., None]).any(-1).all()
    assert torch.equal(walk(11).tokens, first.tokens)
    assert any(not torch.equal(walk(s).tokens, first.tokens) for s in range(12, 20))


def test_gold_enters_the_loss_candidates_only():
    selector = _selector()
    logits, hidden, gen = _inputs(shape=(1, 4))
    served = logits.topk(K, dim=-1).indices
    outside = logits.argsort(dim=-1)[..., 0]  # the least likely token: never in the top-K
    gold = torch.stack([served[0, 0, 2], outside[0, 1], served[0, 2, 0], outside[0, 3]])[None]
    preds = torch.randint(0, V, (1, 4), generator=gen)
    out = selector.scores(logits, hidden, preds, gold)
    plain = selector.scores(logits, hidden, preds)
    assert torch.equal(out.candidates, served) and torch.equal(plain.candidates, served)
    assert out.gold_in_top_k.tolist() == [[True, False, True, False]]
    assert out.gold_index.tolist() == [[2, K - 1, 0, K - 1]]
    assert torch.equal(out.loss_candidates.gather(-1, out.gold_index[..., None])[..., 0], gold)
    assert torch.equal(out.loss_candidates[..., :-1], served[..., :-1])
    torch.testing.assert_close(out.scores[..., :-1], plain.scores[..., :-1], atol=0, rtol=0)
    assert torch.equal(selector.walk(logits, hidden, preds[:, 0]).candidates, served)


def test_selector_loss_reaches_the_drafter_and_a_fresh_projection():
    """U keeps its gradient (the loss trains the drafter's hidden states too) and a zero
    ``hidden_projection`` still gets one, so training leaves the unary path."""
    selector = _selector(pair=False)
    logits, hidden, gen = _inputs()
    logits.requires_grad_()
    preds = torch.randint(0, V, (2, 6), generator=gen)
    gold = torch.randint(0, V, (2, 6), generator=gen)
    out = selector.scores(logits, hidden, preds, gold)
    loss = torch.nn.functional.cross_entropy(out.scores.flatten(0, 1), out.gold_index.flatten())
    loss.backward()
    assert logits.grad.abs().sum() > 0
    assert selector.hidden_projection.weight.grad.abs().sum() > 0


def test_selector_sizes_come_from_the_config(drafter):
    with pytest.raises(ValueError, match="selector_rank"):
        CandidateSelector.from_config(drafter.config)
    assert draft_value(_dflash2_config(drafter.config, top_k=3), "selector_top_k") == 3
