"""The objective's options (KL to the target, ce+kl, D-PACE position weights) and the drafter's
layer options (sliding-window and causal layers)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BLOCK_SIZE,
    assert_drafts_losslessly,
    dense_blocks,
    drafter_grads,
    stopped_and_resumed,
    tiny_drafter,
)
from transformers import AutoModel

from dflash.config.schema import ObjectiveConfig
from dflash.features.target_forward import target_features
from dflash.model import losses, objective
from dflash.model.drafter import PAPER_RULE, layer_rules, rule_masks
from dflash.model.export import config_json, export_drafter, read_config
from dflash.model.labels import block_labels
from dflash.model.losses import WeightedHeadLoss, head_terms
from dflash.model.objective import Objective, dflash_objective
from dflash.model.position_weights import position_weight
from dflash.objectives.weights.decay import decay_weights
from dflash.objectives.weights.dpace import dpace_weights

V, H = 50, 16


def _head(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=gen), torch.randn(V, generator=gen)


def _weighted(hidden, teacher, labels, weights, name, rows=3, blocks=None):
    """``WeightedHeadLoss`` of the loss ``name``, D-PACE weighted (alpha 0.5) over ``blocks``
    (the labels' places among ``[B, bs]``) where they are given."""
    weight, bias = _head()
    reweigh = None
    if blocks is not None:
        reweigh = position_weight("dpace").labels(*blocks, Objective(name, "dpace", 0.5))
    out, _, used = WeightedHeadLoss.apply(
        hidden, weight, bias, labels, teacher, weights, rows, losses.loss(name), reweigh
    )
    return out, used


def test_kl_to_the_targets_own_distribution_has_zero_gradient():
    """Temperature 1, no position weights: drafter logits equal to the target's are optimal."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (10,), generator=gen)
    loss, _ = _weighted(hidden, hidden.detach().clone(), labels, torch.ones(10), "kl")
    loss.backward()
    assert loss.abs() < 1e-5
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.parametrize("loss", ["ce", "kl", "ce+kl"])
def test_chunked_losses_equal_full_logits_and_autograd(loss):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, H, generator=gen, requires_grad=True)
    teacher = torch.randn(11, H, generator=gen)
    labels = torch.randint(0, V, (11,), generator=gen)
    weights = torch.rand(11, generator=gen)
    got, _ = _weighted(hidden, teacher, labels, weights, loss)
    (got_grad,) = torch.autograd.grad(got, hidden)

    weight, bias = _head()
    log_q = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    log_p = F.log_softmax(F.linear(teacher, weight, bias), dim=-1)
    per_label = torch.zeros(11)
    if "ce" in loss.split("+"):
        per_label = per_label + F.nll_loss(log_q, labels, reduction="none")
    if "kl" in loss:
        per_label = per_label + F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    want = (weights * per_label).sum()
    (want_grad,) = torch.autograd.grad(want, hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def _dpace_reference(q: list[list[float]], counted: list[list[bool]], alpha: float):
    """D-PACE written out: w_k = Σ_{t>=k, counted} Π_{j<=t, counted} ((1-alpha) q_j + alpha)."""
    out = []
    for qs, cs in zip(q, counted, strict=True):
        row = []
        for k in range(len(qs)):
            total = 0.0
            for t in range(k, len(qs)):
                if not cs[t]:
                    continue
                reach = 1.0
                for j in range(t + 1):
                    if cs[j]:
                        reach *= (1 - alpha) * qs[j] + alpha
                total += reach
            row.append(total if cs[k] else 0.0)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpace_weights_match_the_formula(alpha):
    gen = torch.Generator().manual_seed(3)
    q = torch.rand(5, 6, generator=gen)
    counted = torch.rand(5, 6, generator=gen) < 0.7
    counted[:, 0] = False  # the anchor slot
    got = dpace_weights(q, counted, alpha)
    want = _dpace_reference(q.tolist(), counted.tolist(), alpha)
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-6)
    if alpha == 1.0:  # no confidence: slot k weighs the number of counted slots from k on
        assert got[counted].min() >= 1.0


def test_dpace_weights_are_built_from_the_labels_confidence_and_carry_no_gradient():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, H, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (6,), generator=gen)
    index = torch.tensor([1, 2, 3, 5, 6, 7])  # two blocks of 4, slot 0 never counts
    loss, used = _weighted(hidden, None, labels, torch.ones(6), "ce", blocks=(index, (2, 4)))
    weight, bias = _head()
    log_q = F.log_softmax(F.linear(hidden.detach(), weight, bias), dim=-1)
    ce = F.nll_loss(log_q, labels, reduction="none")
    dense, counted = torch.zeros(8), torch.zeros(8, dtype=torch.bool)
    dense[index], counted[index] = torch.exp(-ce), True
    want = dpace_weights(dense.view(2, 4), counted.view(2, 4), 0.5).flatten()[index]
    torch.testing.assert_close(used, want)
    torch.testing.assert_close(loss, (want * ce).sum(), atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(loss, hidden)
    (want_grad,) = torch.autograd.grad((want * F.cross_entropy(
        F.linear(hidden, weight, bias), labels, reduction="none")).sum(), hidden)  # fmt: skip
    torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=1e-5)


def test_head_terms_confidence_is_the_labels_probability():
    gen = torch.Generator().manual_seed(5)
    hidden, labels = torch.randn(4, H, generator=gen), torch.randint(0, V, (4,), generator=gen)
    weight, bias = _head()
    _, confidence, hits, grads = head_terms(
        hidden, weight, bias, labels, None, losses.loss("ce"), 2, grad=False
    )
    probs = F.softmax(F.linear(hidden, weight, bias), dim=-1)
    torch.testing.assert_close(confidence, probs[torch.arange(4), labels])
    assert torch.equal(hits, probs.argmax(-1) == labels) and grads is None


def _reference(drafter, target, ids, loss_mask, docs, pos, anchors, how: Objective):
    """The objective with a dense mask, full logits, and the target's own forward for the
    distribution (its logits at p + k - 1), one document per row."""
    bs, rows = drafter.config.block_size, anchors.shape[0]
    slot = torch.arange(bs)
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    hidden, labels, counts = dense_blocks(drafter, features, ids, loss_mask, docs, pos, anchors)
    log_q = F.log_softmax(drafter.logits(hidden).float(), dim=-1)
    ce = -log_q.gather(-1, labels[..., None])[..., 0]
    with torch.no_grad():
        target_logits = target(input_ids=ids, position_ids=pos).logits.float()
    before = (anchors[:, :, None] + slot - 1).clamp(min=0)
    log_p = F.log_softmax(target_logits[torch.arange(rows)[:, None, None], before], dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    per_label = {"ce": ce, "kl": kl, "ce+kl": ce + kl}[how.loss]
    if how.position_weight == "decay":
        weights = decay_weights(bs, 7.0).expand_as(ce) * counts
    else:
        confidence = torch.exp(-ce.detach()).flatten(0, 1)
        weights = dpace_weights(confidence, counts.flatten(0, 1), how.dpace_alpha).view_as(ce)
    return (weights * per_label)[counts].sum()


@pytest.mark.parametrize(
    "how", [Objective("kl", "decay"), Objective("ce+kl", "dpace", 0.3), Objective("ce", "dpace")]
)
def test_objective_options_equal_the_dense_reference(target, drafter, monkeypatch, how):
    """Chunked loss, the target's last hidden state through the head, the two-part kernel and
    D-PACE over the anchors laid end to end: as full logits, a dense mask and HF's own logits."""
    monkeypatch.setattr(objective, "chunk_rows", lambda vocab_size, device: 5)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 290, (2, 13), generator=gen)
    docs, pos = torch.zeros(2, 13, dtype=torch.long), torch.arange(13).expand(2, 13)
    loss_mask = torch.rand(2, 13, generator=gen) < 0.85
    anchors = torch.tensor([[0, 3, 7], [2, 6, -1]])
    ref = _reference(drafter, target, ids, loss_mask, docs, pos, anchors, how)
    ref_grads = drafter_grads(drafter, ref)
    features = target_features(
        target, ids, pos, docs, drafter.config.target_layer_ids, last=how.distills
    )
    out = dflash_objective(
        drafter, features, ids, loss_mask, docs, pos, anchors, 7.0, flex=False, objective=how
    )
    grads = drafter_grads(drafter, out.loss_sum)
    torch.testing.assert_close(out.loss_sum, ref, atol=1e-4, rtol=1e-4)
    if how.position_weight == "dpace":  # normalised by the label count
        assert out.weight_sum == block_labels(ids, loss_mask, docs, anchors, BLOCK_SIZE)[1].sum()
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def packed_and_alone(loss, a, b, anchors, alone_anchors):
    """``loss(ids, docs, pos, anchors)`` of documents ``a`` and ``b`` packed in one row, and the
    sum of their losses each in a row of its own (``alone_anchors``, one list each)."""
    docs = torch.cat([torch.full((len(a),), 0), torch.full((len(b),), 1)])[None]
    pos = torch.cat([torch.arange(len(a)), torch.arange(len(b))])[None]
    with torch.no_grad():
        packed = loss(torch.cat([a, b])[None], docs, pos, torch.tensor([anchors]))
        alone = [
            loss(ids[None], torch.zeros_like(ids)[None], torch.arange(len(ids))[None],
                 torch.tensor([at]))
            for ids, at in zip((a, b), alone_anchors, strict=True)
        ]  # fmt: skip
    return packed, alone[0] + alone[1]


def test_packed_rows_give_each_document_its_own_target_distribution(target, drafter):
    """A packed row's last hidden state is each document's own: the kl loss equals the sum
    over the documents run one per row."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randint(1, 290, (9,), generator=gen), torch.randint(1, 290, (8,), generator=gen)
    how = Objective("kl", "decay")

    def loss(ids, docs, pos, anchors):
        mask = docs >= 0
        feats = target_features(target, ids, pos, docs, drafter.config.target_layer_ids, last=True)
        args = (drafter, feats, ids, mask, docs, pos, anchors, 7.0)
        return dflash_objective(*args, flex=False, objective=how).loss_sum

    packed, alone = packed_and_alone(loss, a, b, [1, 4, 9, 12], ([1, 4], [0, 3]))
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_objective_params_are_typed_and_default_to_the_paper():
    o = ObjectiveConfig()
    assert (o.loss, o.position_weight) == ("ce", "decay")
    with pytest.raises(ValueError, match="loss"):
        ObjectiveConfig(loss="jsd")
    with pytest.raises(ValueError, match="dpace_alpha"):
        ObjectiveConfig(dpace_alpha=1.5)


def _brute_force_mask(anchors, docs, pos, bs, window, causal):
    """The rule pair by pair: the paper's (context strictly before the anchor in its document,
    its own block) narrowed by the window in document positions and by causality."""
    R, T = docs.shape
    A = anchors.shape[1]
    out = torch.zeros(R, A * bs, T + A * bs, dtype=torch.bool)
    for r in range(R):
        for a in range(A):
            p = int(anchors[r, a])
            if p < 0:
                continue
            for k in range(bs):
                q = int(pos[r, p]) + k
                for j in range(p):
                    gap = q - int(pos[r, j])
                    same = docs[r, j] == docs[r, p]
                    near = window is None or gap < window
                    out[r, a * bs + k, j] = bool(same) and near
                for i in range(bs):
                    ok = (not causal or i <= k) and (window is None or k - i < window)
                    out[r, a * bs + k, T + a * bs + i] = ok
    return out


@pytest.mark.parametrize("window, causal", [(3, False), (5, True), (None, True)])
def test_rule_masks_match_a_brute_force_rule_in_packed_rows(window, causal):
    docs = torch.tensor([[0] * 9 + [1] * 7 + [-1] * 2, [0] * 12 + [1] * 6])
    pos = torch.tensor([list(range(9)) + list(range(7)) + [0, 0], list(range(12)) + list(range(6))])
    anchors = torch.tensor([[2, 7, 9, 12], [0, 5, 11, 13]])
    block_pos = (pos.gather(1, anchors)[:, :, None] + torch.arange(BLOCK_SIZE)).flatten(1)
    masks = rule_masks(None, {(window, causal)}, anchors, docs, BLOCK_SIZE, pos, block_pos)
    want = _brute_force_mask(anchors, docs, pos, BLOCK_SIZE, window, causal)
    assert masks[PAPER_RULE] is None and torch.equal(masks[(window, causal)], want)


def _windowed(target, layer_types=("sliding_attention", "full_attention"), window=3, causal=True):
    return tiny_drafter(
        target, len(layer_types), seed=2, layer_types=list(layer_types), sliding_window=window,
        causal=causal,
    )  # fmt: skip


def test_layer_rules_follow_layer_types_window_and_causal(target, drafter):
    assert layer_rules(drafter.config) == {PAPER_RULE}
    windowed = _windowed(target)
    assert layer_rules(windowed.config) == {(3, True), (None, True)}
    back = read_config(config_json(windowed.config, target.config))
    assert [back.attention_rule(i) for i in range(2)] == [(3, True), (None, True)]


def test_a_window_counts_inside_each_document_of_a_packed_row(target):
    """Packed, the sliding-window causal drafter's loss is the sum of its documents' alone,
    with a window shorter than the documents."""
    windowed = _windowed(target)
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randint(1, 290, (10,), generator=gen), torch.randint(1, 290, (9,), generator=gen)

    def loss(ids, docs, pos, anchors):
        feats = target_features(target, ids, pos, docs, windowed.config.target_layer_ids)
        args = (windowed, feats, ids, docs >= 0, docs, pos, anchors, 7.0)
        return dflash_objective(*args, flex=False).loss_sum

    packed, alone = packed_and_alone(loss, a, b, [2, 5, 10, 14], ([2, 5], [0, 4]))
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_a_sliding_window_drafter_exports_its_layers_and_decodes_losslessly(
    target,
    tmp_path,
    hub_modules,
):
    windowed = _windowed(target)
    export_drafter(windowed, tmp_path / "drafter", target.config)
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 3 and config["use_sliding_window"] is True
    assert config["dflash_config"]["causal"] is True
    model = AutoModel.from_pretrained(
        tmp_path / "drafter", trust_remote_code=True, local_files_only=True
    ).eval()
    # The shipped dflash.py applies the trained rule: its drafts are the trainer's, whose
    # training mask over one anchor at the context's end is the same attention.
    torch.manual_seed(0)
    features, block = torch.randn(1, 7, 2 * 32), torch.randint(0, 300, (1, BLOCK_SIZE))
    positions = torch.arange(7 + BLOCK_SIZE)[None]
    docs = torch.zeros(1, 7 + BLOCK_SIZE, dtype=torch.long)
    anchors = torch.tensor([[7]])
    masks = rule_masks(None, layer_rules(windowed.config), anchors, docs, BLOCK_SIZE, positions,
                       positions[:, 7:])  # fmt: skip
    padded = torch.cat([features, torch.zeros(1, BLOCK_SIZE, 2 * 32)], dim=1)
    with torch.no_grad():
        theirs = model(target.get_input_embeddings()(block), features, positions)
        cached = windowed(block, positions[:, 7:], features, positions[:, :7])
        trained = windowed(block, positions[:, 7:], padded, positions, masks)
    torch.testing.assert_close(theirs, cached)
    torch.testing.assert_close(theirs, trained)
    assert_drafts_losslessly(model, target)


def test_drafter_layer_params_are_checked():
    from dflash.config.schema import DrafterConfig

    DrafterConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                  sliding_window=8, causal=True)  # fmt: skip
    with pytest.raises(ValueError, match="drafter.layer_types"):
        DrafterConfig(num_hidden_layers=2, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="drafter.sliding_window"):
        DrafterConfig(num_hidden_layers=1, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match="drafter.sliding_window"):
        DrafterConfig(num_hidden_layers=1, sliding_window=4)
    with pytest.raises(ValueError, match="layer_types"):
        DrafterConfig(num_hidden_layers=1, layer_types=["local"], sliding_window=4)


@pytest.mark.slow
def test_kl_dpace_and_sliding_window_train_and_resume_exactly(
    tiny_workspace, tmp_path, monkeypatch, capsys
):
    """Stopped after a checkpoint and resumed, a run with the options ends bitwise where an
    uninterrupted one does. In process, on one rank: what a real SIGKILL of two ranks leaves
    behind is test_train.py's to prove, for every option alike."""
    sets = [
        "train.world_size=1",
        "train.epochs=1",
        "train.checkpoint_every=3",
        "objective.loss=ce+kl",
        "objective.position_weight=dpace",
        "drafter.layer_types=[sliding_attention]",
        "drafter.sliding_window=8",
        "drafter.causal=true",
    ]
    resumed = tmp_path / "resumed"
    whole, again = stopped_and_resumed(tiny_workspace, resumed, sets, monkeypatch, capsys)
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
