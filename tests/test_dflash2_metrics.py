"""DFlash 2's training figures on the held-out batch: simulated τ along the selector's walk,
top-K recall, teacher-forced selector accuracy and path accuracy."""

import pytest
import torch
from conftest import MASK_ID, tiny_drafter
from test_dflash2_packed import _randomize_dflash2_, make_dflash2
from test_dflash2_upgrade import _trained_dflash, _upgraded

from dflash.features.target_forward import target_features
from dflash.model.dflash2 import teacher_predecessors
from dflash.model.objective import PAPER
from dflash.train.simulated import SimulatedTau

NO_AUTOCAST = torch.autocast("cpu", enabled=False)
SELECTOR_FIGURES = {
    "val_top_k_recall",
    "val_selector_accuracy",
    "val_path_accuracy",
    "val_top_k_oracle_tau",
}


def _simulated(target, drafter) -> SimulatedTau:
    """Two documents of answers after short prompts, every answer token an anchor."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MASK_ID, (1, 40), generator=gen)
    docs = torch.tensor([[0] * 18 + [1] * 22])
    pos = torch.cat([torch.arange(18), torch.arange(22)])[None]
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :6] = loss_mask[0, 18:24] = 0
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    row = {"input_ids": ids, "document_ids": docs, "position_ids": pos, "loss_mask": loss_mask}
    return SimulatedTau.from_row(row | {"features": features}, drafter, NO_AUTOCAST)


@torch.no_grad()
def _walked_alone(simulated: SimulatedTau, drafter, index: int) -> int:
    """One block as SelectorProposer drafts it: its document's context only, then the walk."""
    bs, anchor = drafter.config.block_size, int(simulated.anchors[index])
    docs = simulated.document_ids[0]
    start = int(torch.nonzero(docs == docs[anchor])[0, 0])
    block = slice(index * bs, (index + 1) * bs)
    ids = simulated.block_ids[:, block]
    hidden = drafter(
        ids, simulated.block_positions[:, block],
        simulated.features[:, start:anchor], simulated.context_positions[:, start:anchor],
    )  # fmt: skip
    drafts = drafter.walk(hidden, ids[:, 0]).tokens[0]
    hits = (drafts == simulated.labels[index, 1:]) & simulated.counts[index, 1:]
    return 1 + int(hits.long().cumprod(0).sum())


def test_simulated_tau_follows_the_selectors_walk(target):
    drafter = _randomize_dflash2_(make_dflash2(target, transform=False), draw=2)
    simulated = _simulated(target, drafter)
    taus = simulated.block_taus(drafter)
    assert len(taus) == len(simulated.anchors) > 20
    for index in range(len(taus)):
        assert int(taus[index]) == _walked_alone(simulated, drafter, index), index
    slots = simulated._slots(drafter)
    assert not torch.equal(slots["drafts"][:, 1:], slots["top"][:, 1:])  # the walk is no argmax


def test_an_upgraded_drafter_has_the_dflash_drafters_simulated_tau(target):
    dflash = _trained_dflash(target)
    simulated = _simulated(target, dflash)
    dflash2 = _upgraded(dflash, target)
    assert torch.equal(simulated.block_taus(dflash2), simulated.block_taus(dflash))


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_validation_figures_of_each_family(target, kind):
    if kind == "dflash":
        drafter = tiny_drafter(target)
    else:
        drafter = _randomize_dflash2_(make_dflash2(target, transform=False), draw=2)
    figures = _simulated(target, drafter).validate(drafter, PAPER, 7.0)
    assert (SELECTOR_FIGURES <= set(figures)) == (kind == "dflash2")
    for name, value in figures.items():
        if not name.endswith(("_loss", "_tau")):
            assert 0.0 <= value <= 1.0, name
    if kind == "dflash2":  # the walk drafts among the top-K: it never beats the oracle
        assert figures["val_simulated_tau"] <= figures["val_top_k_oracle_tau"] <= 4


def test_the_held_out_loss_holds_the_selectors_term_as_training_weighs_it(target):
    """``val_loss`` is the head's decay-weighted CE plus ``selector_alpha`` x the selector's
    K-way CE of the same slots, each slot weighed alike: worked out here slot by slot."""
    drafter = _randomize_dflash2_(make_dflash2(target, transform=False), draw=3)
    simulated = _simulated(target, drafter)
    losses = {a: simulated.validate(drafter, PAPER._replace(selector_alpha=a), 7.0)["val_loss"]
              for a in (0.0, 1.0, 2.0)}  # fmt: skip
    labels, counts = simulated.labels, simulated.counts
    bs = labels.shape[1]
    decay = torch.exp(-(torch.arange(bs, dtype=torch.float64) - 1) / 7.0)
    weights = torch.where(counts, decay, 0.0)
    with torch.no_grad():
        hidden = drafter(
            simulated.block_ids, simulated.block_positions, simulated.features,
            simulated.context_positions, simulated.mask,
        )[0]  # fmt: skip
        scores = drafter.selector_scores(
            hidden, teacher_predecessors(labels.flatten(), bs), labels.flatten()
        )
    total, weight = 0.0, 0.0
    for slot in torch.nonzero(weights.flatten()).flatten().tolist():
        row = scores.scores[slot].double()
        total += float(weights.flatten()[slot]) * float(
            torch.logsumexp(row, 0) - row[scores.gold_index[slot]]
        )
        weight += float(weights.flatten()[slot])
    assert losses[1.0] - losses[0.0] == pytest.approx(total / weight, rel=1e-6)
    assert losses[2.0] - losses[0.0] == pytest.approx(2 * total / weight, rel=1e-6)
