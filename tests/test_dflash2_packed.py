"""A packed row of DFlash 2 blocks is, block by block, each block drafted alone.

The reference is a second implementation written from the contract (z-lab's
``DFlash2DraftModel`` forward and ``CandidateSelector`` scoring), one block at a time with plain
loops and nothing of the code under test but its weights: the block ``[anchor, MASK...]``
attends to the fused target features of its document before the anchor and to its own slots;
each layer is ``x + finish(attn(prepare(norm x)))``, then the same around the MLP, the conv
running over the block alone from slot 0 (the anchor); the selector scores U's top-K given the
block's previous token, the anchor for slot 1. The packed side is the training forward over
several documents, padded rows and padded anchors, in every layout the objective builds.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import BLOCK_SIZE, MASK_ID
from torch import nn

from dflash.model.dflash2 import teacher_predecessors
from dflash.model.dflash2_drafter import DFlash2Drafter, DFlash2Sizes
from dflash.model.drafter import PAPER_RULE, layer_rules, rule_masks
from dflash.model.drafter_attention import build_attention_mask, build_block_mask
from dflash.model.labels import block_labels

SIZES = DFlash2Sizes(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5)
MULTIPLIER, SOFTCAP = 0.7, 0.5
ATOL = 1e-5

# Two rows of 20 positions: documents of 7 and 9 then padding, and of 12 and 5 then padding.
DOCS = torch.tensor([[0] * 7 + [1] * 9 + [-1] * 4, [0] * 12 + [1] * 5 + [-1] * 3])
# Anchors at a document's start (no context), mid-document, near its end (the block runs past
# it), and -1 (a padded anchor).
ANCHORS = torch.tensor([[0, 3, 6, 7, 13, -1, -1], [2, 5, 10, 12, 13, 16, -1]])


def _positions(docs: torch.Tensor) -> torch.Tensor:
    """Positions restarting at every document; 0 on padding."""
    out = torch.zeros_like(docs)
    for r in range(docs.shape[0]):
        for j in range(1, docs.shape[1]):
            same = docs[r, j] >= 0 and docs[r, j] == docs[r, j - 1]
            out[r, j] = out[r, j - 1] + 1 if same else 0
    return out


def _randomize_dflash2_(drafter: DFlash2Drafter, draw: int) -> DFlash2Drafter:
    """Trained-looking convs (identity plus noise) and selector, so no term hides at 0."""
    gen = torch.Generator().manual_seed(draw)

    def noise(p, scale):
        return torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale

    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(noise(conv.base_kernel, 0.3))
                conv.kernel_projection.weight.copy_(noise(conv.kernel_projection.weight, 0.1))
        for p in drafter.candidate_selector.parameters():
            p.copy_(noise(p, 0.5))
    return drafter


def make_dflash2(target, rule: str = "full", sizes: DFlash2Sizes = SIZES, transform=True):
    """A tiny DFlash 2 drafter: two layers, ``rule`` ``full`` (bidirectional) or ``sliding``
    (layer 0 sliding over 3 positions), the served unary transform set where ``transform``."""
    options = {"block_size": BLOCK_SIZE, "mask_token_id": MASK_ID}
    if rule == "sliding":
        options |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    drafter = DFlash2Drafter.from_target(
        target, sizes=sizes, num_hidden_layers=2, num_target_features=2, seed=4, **options
    )
    if transform:
        drafter.config.dflash_config |= {
            "output_multiplier": MULTIPLIER,
            "final_logit_softcapping": SOFTCAP,
        }
    return drafter


def packed_inputs(drafter, draw: int = 0):
    """Two padded rows: token ids, fused-feature inputs, documents, positions."""
    gen = torch.Generator().manual_seed(draw)
    ids = torch.randint(0, MASK_ID, DOCS.shape, generator=gen)
    width = drafter.fc.weight.shape[1]
    features = torch.randn(*DOCS.shape, width, generator=gen)
    return ids, features, DOCS, _positions(DOCS)


def one_row(ids, features, docs, pos, anchors):
    """The rows laid end to end as one, with only the real anchors, as the objective trains."""
    R, T = docs.shape
    row = torch.arange(R)[:, None]
    flat_docs = torch.where(docs >= 0, docs + row * T, -1).reshape(1, R * T)
    real = (anchors + row * T)[anchors >= 0][None]
    flat = [x.reshape(1, R * T) for x in (ids, pos)]
    return flat[0], features.reshape(1, R * T, -1), flat_docs, flat[1], real


def packed_forward(drafter, ids, features, docs, pos, anchors, mask_kind: str):
    """The training forward's blocks as the objective lays them out: hidden ``[R, A, bs, H]``
    and the blocks' tokens ``[R, A, bs]`` (slot 0 the anchor, then the labels)."""
    bs, T = drafter.config.block_size, ids.shape[1]
    slot = torch.arange(bs)
    safe = anchors.clamp(min=0)
    block_ids = torch.where(slot == 0, ids.gather(1, safe)[:, :, None], MASK_ID).flatten(1)
    block_pos = (pos.gather(1, safe)[:, :, None] + slot).flatten(1)
    if mask_kind == "dense":
        mask = build_block_mask(anchors, docs, bs, T)
    else:
        mask = build_attention_mask(anchors, docs, bs, T, flex=False)
    rules = layer_rules(drafter.config)
    if rules != {PAPER_RULE}:
        mask = rule_masks(mask, rules, anchors, docs, bs, pos, block_pos)
    hidden = drafter(block_ids, block_pos, features, pos, mask)
    tokens, _ = block_labels(ids, torch.ones_like(ids), docs, anchors, bs)
    return hidden.view(*anchors.shape, bs, -1), tokens


# The reference: one block alone, from the contract, in fp64.


def _w(module: nn.Module) -> torch.Tensor:
    return module.weight.detach().double()


def _rms(x, norm: nn.RMSNorm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * _w(norm)


def _rope(x, positions, theta):
    """``x [L, heads, d]`` rotated at ``positions [L]``: Qwen's rotate-half layout."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i, p in enumerate(positions.tolist()):
        freq = theta ** -(torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.cat([p * freq, p * freq])
        half = torch.cat([-x[i, :, d // 2 :], x[i, :, : d // 2]], dim=-1)
        out[i] = x[i] * angle.cos() + half * angle.sin()
    return out


def _conv(conv, u, x, side: int):
    """``y_t = sum_{j <= t} (base[side, j] + D(u_t)[side, j, group]) * x_{t-j}`` in one block."""
    taps, gs = conv.kernel_size, conv.group_size
    groups = u.shape[-1] // gs
    group = torch.arange(u.shape[-1]) // gs
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        d = _w(conv.kernel_projection) @ u[t]
        for j in range(min(taps, t + 1)):
            dynamic = d[side * taps * groups + j * groups + group]
            y[t] += (conv.base_kernel[side, j].detach().double() + dynamic) * x[t - j]
    return y


def _attention(attn, config, layer, x, context, q_pos, k_pos):
    """Queries from the block; keys and values from context then block (KV injection)."""
    heads, kv_heads, d = attn.heads, attn.kv_heads, attn.d
    keys_in = torch.cat([context, x])
    q = _rope(_rms((x @ _w(attn.q_proj).T).view(-1, heads, d), attn.q_norm), q_pos, config.theta)
    k = _rope(
        _rms((keys_in @ _w(attn.k_proj).T).view(-1, kv_heads, d), attn.k_norm), k_pos, config.theta
    )
    v = (keys_in @ _w(attn.v_proj).T).view(-1, kv_heads, d)
    window, causal = config.attention_rule(layer)
    out = torch.zeros(x.shape[0], heads, d, dtype=torch.float64)
    for i in range(x.shape[0]):
        for h in range(heads):
            g = h // (heads // kv_heads)
            seen = [
                j
                for j in range(len(k_pos))
                if (not causal or q_pos[i] >= k_pos[j])
                and (window is None or q_pos[i] - k_pos[j] < window)
            ]
            scores = torch.stack([q[i, h] @ k[j, g] for j in seen]) * d**-0.5
            out[i, h] = torch.softmax(scores, 0) @ v[seen, g]
    return out.flatten(1) @ _w(attn.o_proj).T


def reference_block(drafter, target, context_features, context_pos, anchor_token, anchor_pos):
    """Hidden states ``[bs, H]`` and logits ``[bs, V]`` of one block drafted alone."""
    c, bs = drafter.config, drafter.config.block_size
    block = torch.tensor([anchor_token] + [MASK_ID] * (bs - 1))
    x = target.get_input_embeddings().weight.detach().double()[block]
    context = _rms(context_features.double() @ _w(drafter.fc).T, drafter.hidden_norm)
    q_pos = anchor_pos + torch.arange(bs)
    k_pos = torch.cat([context_pos, q_pos])
    for i, layer in enumerate(drafter.layers):
        u = _rms(x, layer.input_layernorm)
        a = _attention(
            layer.self_attn, c, i, _conv(layer.attention_conv, u, u, 0), context, q_pos, k_pos
        )
        x = x + _conv(layer.attention_conv, u, a, 1)
        u = _rms(x, layer.post_attention_layernorm)
        v = _conv(layer.mlp_conv, u, u, 0)
        mlp = layer.mlp
        m = (F.silu(v @ _w(mlp.gate_proj).T) * (v @ _w(mlp.up_proj).T)) @ _w(mlp.down_proj).T
        x = x + _conv(layer.mlp_conv, u, m, 1)
    hidden = _rms(x, drafter.norm)
    return hidden, hidden @ _w(target.get_output_embeddings()).T


def reference_scores(drafter, hidden, logits, tokens):
    """Each prediction slot t's top-K of U and ``S_t(tokens[t-1], .)``: ``[bs-1, K]`` each."""
    selector, dflash = drafter.candidate_selector, drafter.config.dflash_config
    m, cap = dflash.get("output_multiplier", 1.0), dflash.get("final_logit_softcapping")
    codebook_a = selector.predecessor_codebook.detach().double()
    codebook_b = selector.successor_codebook.detach().double()
    candidates, scores = [], []
    for t in range(1, hidden.shape[0]):
        u = cap * torch.tanh(m * logits[t] / cap) if cap else m * logits[t]
        top = u.topk(selector.top_k).indices
        projected = _w(selector.hidden_projection) @ hidden[t]
        a = codebook_a[tokens[t - 1]]
        pair = torch.stack([(a * projected * codebook_b[b]).sum() for b in top.tolist()])
        candidates.append(top)
        scores.append(u[top] + pair)
    return torch.stack(candidates), torch.stack(scores)


def reference(drafter, target, ids, features, docs, pos, row, anchor, tokens):
    """Logits ``[bs, V]`` and selector candidates and scores ``[bs-1, K]`` of the block at
    ``anchor`` of ``row``, alone: its context is its document's positions before the anchor."""
    doc = docs[row, anchor]
    before = [j for j in range(anchor) if docs[row, j] == doc]
    hidden, logits = reference_block(
        drafter, target, features[row, before], pos[row, before], int(ids[row, anchor]),
        int(pos[row, anchor]),
    )  # fmt: skip
    return (logits, *reference_scores(drafter, hidden, logits, tokens.tolist()))


def packed_scores(drafter, hidden, tokens):
    """The drafter's logits and teacher-forced selector scores of its packed blocks."""
    bs = drafter.config.block_size
    predecessors = teacher_predecessors(tokens.flatten(1), bs).view(tokens.shape)
    scores = drafter.selector_scores(hidden.flatten(0, 2), predecessors.flatten(), rows=7)
    shape = (*tokens.shape, -1)
    return drafter.logits(hidden), scores.candidates.view(shape), scores.scores.view(shape)


@pytest.mark.parametrize("layout", ["rows-two-part", "rows-dense", "one-row-two-part"])
@pytest.mark.parametrize("rule", ["full", "sliding"])
def test_packed_blocks_are_each_block_drafted_alone(target, layout, rule):
    drafter = _randomize_dflash2_(make_dflash2(target, rule), draw=1)
    ids, features, docs, pos = packed_inputs(drafter)
    inputs, anchors = (ids, features, docs, pos), ANCHORS
    if layout.startswith("one-row"):
        *flat, anchors = one_row(ids, features, docs, pos, ANCHORS)
        inputs = (flat[0], flat[1], flat[2], flat[3])
    mask_kind = "dense" if layout.endswith("dense") else "two-part"
    with torch.no_grad():
        hidden, tokens = packed_forward(drafter, *inputs, anchors, mask_kind)
        logits, candidates, scores = packed_scores(drafter, hidden, tokens)
    real = [(r, a) for r in range(2) for a in range(ANCHORS.shape[1]) if ANCHORS[r, a] >= 0]
    flat_index = {ra: i for i, ra in enumerate(real)}
    for r, a in real:
        at = (0, flat_index[(r, a)]) if layout.startswith("one-row") else (r, a)
        want_logits, want_candidates, want_scores = reference(
            drafter, target, ids, features, docs, pos, r, int(ANCHORS[r, a]), tokens[at]
        )
        torch.testing.assert_close(logits[at].double(), want_logits, atol=ATOL, rtol=0)
        assert torch.equal(candidates[at][1:], want_candidates)
        torch.testing.assert_close(scores[at][1:].double(), want_scores, atol=ATOL, rtol=0)


def test_the_reference_sees_the_convs_and_the_selector(target):
    """The trained convs and selector change what the block drafts: the comparison above is
    not the DFlash drafter's against itself."""
    drafter = make_dflash2(target)
    ids, features, docs, pos = packed_inputs(drafter)
    with torch.no_grad():
        fresh = packed_scores(
            drafter, *packed_forward(drafter, ids, features, docs, pos, ANCHORS, "dense")
        )
        _randomize_dflash2_(drafter, draw=1)
        trained = packed_scores(
            drafter, *packed_forward(drafter, ids, features, docs, pos, ANCHORS, "dense")
        )
    real = ANCHORS >= 0
    assert not torch.allclose(fresh[0][real], trained[0][real], atol=1e-3)
    assert not torch.allclose(fresh[2][real], trained[2][real], atol=1e-3)


def test_a_conv_across_blocks_would_be_caught(target):
    """The reference is sensitive to a leak: the same packed forward with the conv's block
    doubled (pairs of blocks mixed) no longer matches block by block."""
    drafter = _randomize_dflash2_(make_dflash2(target), draw=1)
    for layer in drafter.layers:
        layer.attention_conv.block_size = layer.mlp_conv.block_size = 2 * BLOCK_SIZE
    ids, features, docs, pos = packed_inputs(drafter)
    with torch.no_grad():
        hidden, tokens = packed_forward(drafter, ids, features, docs, pos, ANCHORS, "two-part")
        logits, _, _ = packed_scores(drafter, hidden, tokens)
    for layer in drafter.layers:
        layer.attention_conv.block_size = layer.mlp_conv.block_size = BLOCK_SIZE
    want, _, _ = reference(drafter, target, ids, features, docs, pos, 0, 3, tokens[0, 1])
    assert not torch.allclose(logits[0, 1].double(), want, atol=ATOL, rtol=0)


def test_selector_scores_chunk_exactly(target):
    """Any ``rows`` gives the one-chunk result (the same candidates; scores up to the matmul's
    rounding), empty inputs included."""
    drafter = _randomize_dflash2_(make_dflash2(target), draw=2)
    ids, features, docs, pos = packed_inputs(drafter)
    with torch.no_grad():
        hidden, tokens = packed_forward(drafter, ids, features, docs, pos, ANCHORS, "two-part")
    hidden = hidden.flatten(0, 2)
    preds = teacher_predecessors(tokens.flatten(1), BLOCK_SIZE).flatten()
    gold = torch.randint(0, MASK_ID, preds.shape, generator=torch.Generator().manual_seed(0))
    whole = drafter.selector_scores(hidden, preds, gold)
    for rows in (1, 5, 1000):
        part = drafter.selector_scores(hidden, preds, gold, rows=rows)
        for name in ("candidates", "loss_candidates", "gold_index", "gold_in_top_k"):
            assert torch.equal(getattr(part, name), getattr(whole, name))
        torch.testing.assert_close(part.scores, whole.scores, atol=ATOL, rtol=0)
    empty = drafter.selector_scores(hidden[:0], preds[:0], gold[:0], rows=3)
    assert empty.scores.shape == (0, SIZES.selector_top_k)
