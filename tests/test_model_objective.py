"""Features, anchors, labels, weights and the loss: same-position, decayed, layout-free."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import BLOCK_SIZE, dense_blocks, drafter_grads

from dflash.features.target_forward import target_features
from dflash.model import drafter as drafter_module
from dflash.model import drafter_attention as attention
from dflash.model import objective
from dflash.model.anchors import sample_anchors
from dflash.model.labels import block_labels
from dflash.model.layer_ids import target_layer_ids
from dflash.model.objective import dflash_objective
from dflash.objectives.weights.decay import decay_weights


def test_target_layer_ids_rule():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert target_layer_ids(6, 3) == [1, 2, 3]
    assert target_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError, match="repeat a layer"):
        target_layer_ids(6, 4)


def test_anchors_stay_inside_the_loss_mask_and_leave_room_for_a_block():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    rng = np.random.default_rng(0)
    anchors = sample_anchors(loss_mask, block_size=4, count=100, rng=rng)
    assert anchors.tolist() == [2, 3, 4, 6]  # all candidates: p <= 10 - 4 with mask 1
    few = sample_anchors(loss_mask, block_size=4, count=2, rng=rng)
    assert len(few) == 2 and set(few) <= {2, 3, 4, 6} and list(few) == sorted(few)
    assert sample_anchors(loss_mask[:3], 4, 5, rng).size == 0


def test_anchors_are_redrawn_by_the_generator_seed():
    loss_mask = np.ones(200)
    draws = [sample_anchors(loss_mask, 16, 8, np.random.default_rng(s)) for s in (0, 0, 1)]
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])


def test_labels_are_same_position_and_slot_zero_is_excluded():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    anchors = torch.tensor([[2, 5, -1]])
    labels, counts = block_labels(input_ids, loss_mask, docs, anchors, BLOCK_SIZE)
    assert labels[0, 0].tolist() == [12, 13, 14, 15]  # slot k predicts input_ids[p + k]
    assert counts[0, 0].tolist() == [False, True, True, False]  # slot 0; loss mask at 5
    assert counts[0, 1].tolist() == [False, False, False, False]  # 6, 7 are another document
    assert not counts[0, 2].any()  # no anchor
    anchors = torch.tensor([[6]])
    _, counts = block_labels(input_ids, loss_mask, torch.zeros_like(docs), anchors, BLOCK_SIZE)
    assert counts[0, 0].tolist() == [False, True, False, False]  # 8, 9 are out of bounds


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15) / 7.0))
    assert math.isclose(float(w[8]), math.exp(-1.0), rel_tol=1e-6)


def _inputs(*rows: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """input_ids, document_ids, loss_mask, position_ids as long tensors."""
    return tuple(torch.tensor(r, dtype=torch.long) for r in rows)


def test_loss_weights_and_accuracy_counts(target, drafter):
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    out = dflash_objective(drafter, features, ids, loss, docs, pos, torch.tensor([[0, 8, -1]]), 7.0)
    assert out.counted.tolist() == [0, 2, 2, 2]
    # Two blocks, each counting slots 1-3 at weights exp(0), exp(-1/7), exp(-2/7):
    # 2 * (1 + 0.866878 + 0.751477) = 5.236710.
    assert out.weight_sum.item() == pytest.approx(5.236710, abs=1e-5)
    assert torch.isfinite(out.loss_sum) and out.loss_sum > 0
    assert (out.correct <= out.counted).all()


def test_gradients_reach_drafter_weights_only(target, drafter):
    for p in target.parameters():
        p.requires_grad_(True)  # even an unfrozen target must get nothing
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    anchors = torch.tensor([[0, 3, 8, -1]])
    drafter.zero_grad()
    dflash_objective(drafter, features, ids, loss, docs, pos, anchors, 7.0).loss_sum.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters())
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    for p in target.parameters():
        p.requires_grad_(False)


def test_recomputed_layers_give_the_same_gradients(target, drafter):
    """``train.recompute`` trades memory for a second forward of the layers, nothing else:
    gradients are bitwise those of the stored activations (the CPU kernel; FlexAttention has
    no backward on CPU)."""
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    anchors = torch.tensor([[0, 3, 8, -1]])
    grads = []
    for recompute in (False, True):
        drafter.recompute = recompute
        drafter.zero_grad()
        out = dflash_objective(drafter, features, ids, loss, docs, pos, anchors, 7.0)
        out.loss_sum.backward()
        grads.append([p.grad.clone() for p in drafter.parameters()])
    drafter.recompute = False
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_packed_and_padded_rows_give_the_same_loss(target, drafter):
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(1, 290, (7,), generator=gen).tolist()
    b = torch.randint(1, 290, (9,), generator=gen).tolist()
    mask_a, mask_b = [0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1]
    anchors_a, anchors_b = [1, 2], [2, 5]
    padded = _inputs(
        [a + [0, 0], b],
        [[0] * 7 + [-1, -1], [0] * 9],
        [mask_a + [0, 0], mask_b],
        [list(range(7)) + [0, 0], list(range(9))],
    )
    packed = _inputs(
        [a + b], [[0] * 7 + [1] * 9], [mask_a + mask_b], [list(range(7)) + list(range(9))]
    )
    ids_pad, docs_pad, loss_pad, pos_pad = padded
    ids_pack, docs_pack, loss_pack, pos_pack = packed

    layers = drafter.config.target_layer_ids
    feats_pad = target_features(target, ids_pad, pos_pad, docs_pad, layers)
    feats_pack = target_features(target, ids_pack, pos_pack, docs_pack, layers)
    torch.testing.assert_close(feats_pack[0, :7], feats_pad[0, :7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats_pack[0, 7:], feats_pad[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(feats_pad[0, 7:], torch.zeros_like(feats_pad[0, 7:]))

    def loss(inputs, feats, anchors):
        ids, docs, mask, pos = inputs
        return dflash_objective(drafter, feats, ids, mask, docs, pos, torch.tensor(anchors), 7.0)

    for pad_anchors, pack_anchors in [
        ([anchors_a, [-1, -1]], [anchors_a + [-1, -1]]),  # document a alone
        ([[-1, -1], anchors_b], [[-1, -1] + [7 + p for p in anchors_b]]),  # document b alone
        ([anchors_a, anchors_b], [anchors_a + [7 + p for p in anchors_b]]),  # both
    ]:
        x, y = loss(padded, feats_pad, pad_anchors), loss(packed, feats_pack, pack_anchors)
        torch.testing.assert_close(x.loss_sum, y.loss_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.weight_sum, y.weight_sum)
        assert torch.equal(x.correct, y.correct) and torch.equal(x.counted, y.counted)


def test_bad_anchors_are_named(target, drafter):
    ids, docs, loss, pos = _inputs(
        [[1, 2, 3, 4, 0]], [[0, 0, 0, 0, -1]], [[1] * 5], [[0, 1, 2, 3, 0]]
    )
    features = torch.zeros(1, 5, 64)
    with pytest.raises(ValueError, match="padding"):
        dflash_objective(drafter, features, ids, loss, docs, pos, torch.tensor([[4]]), 7.0)
    with pytest.raises(ValueError, match="anchors must be"):
        dflash_objective(drafter, features, ids, loss, docs, pos, torch.tensor([[5]]), 7.0)


def test_loss_never_reads_features_at_or_after_the_anchor(target, drafter):
    """The objective as wired (not just the mask builder) keeps the context strictly before p."""
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[6]])

    def loss_sum(f):
        return dflash_objective(drafter, f, ids, loss, docs, pos, anchors, 7.0).loss_sum

    later = features.clone()
    later[:, 6:] = 0.0
    assert torch.equal(loss_sum(later), loss_sum(features))
    earlier = features.clone()
    earlier[:, 5] = 0.0
    assert not torch.equal(loss_sum(earlier), loss_sum(features))


def test_bf16_autocast_loss_is_close_to_fp32(target, drafter):
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    anchors = torch.tensor([[0, 3, 8, -1]])
    fp32 = dflash_objective(drafter, features, ids, loss, docs, pos, anchors, 7.0).loss_sum
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = dflash_objective(drafter, features, ids, loss, docs, pos, anchors, 7.0).loss_sum
    bf16.backward()
    assert torch.isfinite(bf16) and abs(float(bf16) / float(fp32) - 1) < 2e-2


def _unchunked_objective(drafter, features, ids, loss_mask, docs, pos, anchors, gamma):
    """The objective as first written: dense mask, full-vocabulary logits for every label."""
    bs = drafter.config.block_size
    hidden, labels, counts = dense_blocks(drafter, features, ids, loss_mask, docs, pos, anchors)
    logits = drafter.logits(hidden[counts]).float()
    slots = torch.arange(bs).expand_as(labels)[counts]
    weights = decay_weights(bs, gamma)[slots]
    ce = F.cross_entropy(logits, labels[counts], reduction="none")
    hits = logits.argmax(dim=-1) == labels[counts]
    return (weights * ce).sum(), torch.bincount(slots[hits], minlength=bs)


@pytest.mark.parametrize("packed", [False, True])
def test_objective_equals_the_unchunked_dense_computation(target, drafter, monkeypatch, packed):
    """Chunked loss and two-part attention: same loss, hits and gradients as full logits + mask."""
    monkeypatch.setattr(objective, "chunk_rows", lambda vocab_size, device: 7)
    monkeypatch.setattr(attention, "CONTEXT_SCORES_PER_CHUNK", 1)  # one anchor per chunk
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(1, 290, (14,), generator=gen), torch.randint(1, 290, (11,), generator=gen)
    if packed:
        ids = torch.cat([a, b])[None]
        docs = torch.tensor([[0] * 14 + [1] * 11])
        pos = torch.tensor([list(range(14)) + list(range(11))])
        anchors = torch.tensor([[0, 2, 5, 9, 10, 14, 16, 21]])
    else:
        ids = torch.stack([a, torch.cat([b, torch.zeros(3, dtype=torch.long)])])
        docs = torch.tensor([[0] * 14, [0] * 11 + [-1] * 3])
        pos = torch.tensor([list(range(14)), list(range(11)) + [0] * 3])
        anchors = torch.tensor([[1, 4, 6, 10], [0, 3, 7, -1]])
    loss_mask = (docs >= 0) & (torch.rand(docs.shape, generator=gen) < 0.8)
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)

    ref_loss, ref_correct = _unchunked_objective(
        drafter, features, ids, loss_mask, docs, pos, anchors, 7.0
    )
    ref_grads = drafter_grads(drafter, ref_loss)
    out = dflash_objective(drafter, features, ids, loss_mask, docs, pos, anchors, 7.0)
    grads = drafter_grads(drafter, out.loss_sum)
    torch.testing.assert_close(out.loss_sum, ref_loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.correct, ref_correct)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_autocast_gives_the_attention_bf16_inputs(target, drafter, monkeypatch):
    seen = []

    def recording_attend(q, context_kv, block_kv, mask, scale):
        seen.append({t.dtype for t in (q, *context_kv, *block_kv)})
        return attention.attend(q, context_kv, block_kv, mask, scale)

    monkeypatch.setattr(drafter_module, "attend", recording_attend)
    ids, docs, loss, pos = _inputs([list(range(1, 13))], [[0] * 12], [[1] * 12], [list(range(12))])
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dflash_objective(drafter, features, ids, loss, docs, pos, torch.tensor([[0, 3, 8]]), 7.0)
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen)


def test_loss_chunks_stay_on_the_heap_only_where_they_keep_enough_labels():
    """CPU: 16 MiB chunks for a small vocabulary, the 64 MiB bound where 16 MiB would leave too
    few labels a chunk; other devices always take the 64 MiB bound."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert objective.chunk_rows(4096, cpu) == objective.HEAP_LOGITS // 4096
    assert objective.chunk_rows(4096, cuda) == objective.LOGITS_PER_CHUNK // 4096
    assert objective.chunk_rows(151_936, cpu) == objective.LOGITS_PER_CHUNK // 151_936
    assert objective.chunk_rows(1 << 30, cpu) == 1
    for vocab in (4096, 32_000, 151_936):
        rows = objective.chunk_rows(vocab, cpu)
        assert rows * vocab <= objective.LOGITS_PER_CHUNK
        assert rows >= min(objective.MIN_HEAP_ROWS, objective.LOGITS_PER_CHUNK // vocab)
