"""A DFlash 2 drafter made from a DFlash drafter's weights is that drafter at step 0.

Convs start as the identity and the selector's pair term at 0, so the upgraded drafter computes
the DFlash drafter's logits in every packed layout, walks its greedy blocks, and proposes the
same drafts in real speculative decoding; its first gradients still reach the new modules.
"""

import pytest
import torch
from conftest import BLOCK_SIZE, MASK_ID, tiny_drafter
from test_dflash2_packed import ANCHORS, SIZES, one_row, packed_forward, packed_inputs

from dflash.model.dflash2 import teacher_predecessors
from dflash.model.dflash2_drafter import DFlash2Drafter, dflash2_config
from dflash.model.dflash2_generate import SelectorProposer
from dflash.model.generate import DrafterProposer, greedy_generate, speculative_generate


def _trained_dflash(target, draw: int = 7):
    """A DFlash drafter whose weights are not its initial ones."""
    drafter = tiny_drafter(target, seed=draw)
    gen = torch.Generator().manual_seed(draw)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return drafter


def _upgraded(dflash, target):
    config = dflash2_config(dflash.config, SIZES)
    return DFlash2Drafter.from_dflash(config, dflash.state_dict(), target, seed=3)


@pytest.mark.parametrize("layout", ["rows-two-part", "one-row-two-part", "rows-dense"])
def test_upgraded_drafter_computes_the_dflash_logits_and_greedy_blocks(target, layout):
    dflash = _trained_dflash(target)
    dflash2 = _upgraded(dflash, target)
    ids, features, docs, pos = packed_inputs(dflash)
    inputs, anchors = (ids, features, docs, pos), ANCHORS
    if layout.startswith("one-row"):
        *inputs, anchors = one_row(ids, features, docs, pos, ANCHORS)
    mask_kind = "dense" if layout.endswith("dense") else "two-part"
    real = anchors >= 0
    with torch.no_grad():
        hidden, _ = packed_forward(dflash, *inputs, anchors, mask_kind)
        hidden2, tokens = packed_forward(dflash2, *inputs, anchors, mask_kind)
        logits, logits2 = dflash.logits(hidden[real]), dflash2.logits(hidden2[real])
        walk = dflash2.walk(hidden2[real], tokens[real][:, 0])
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=0)
    assert torch.equal(walk.tokens, logits[:, 1:].argmax(dim=-1))


class Recording:
    """A proposer that keeps every block it proposes."""

    def __init__(self, proposer) -> None:
        self.proposer, self.uses_features, self.blocks = proposer, proposer.uses_features, []

    def start(self, *args) -> None:
        self.proposer.start(*args)

    def propose(self, history, position):
        self.blocks.append(self.proposer.propose(history, position))
        return self.blocks[-1]

    def commit(self, *args) -> None:
        self.proposer.commit(*args)


def test_upgraded_drafter_proposes_the_dflash_drafts_in_speculative_decoding(target):
    """Every drafted block is the same, so τ is; the output is the target's greedy one."""
    dflash = _trained_dflash(target)
    dflash2 = _upgraded(dflash, target)
    for prompt in ([5], [1, 2, 3], [7, 250, 7, 250, 7]):
        one, two = Recording(DrafterProposer(dflash)), Recording(SelectorProposer(dflash2))
        first = speculative_generate(target, one, prompt, 16, BLOCK_SIZE)
        second = speculative_generate(target, two, prompt, 16, BLOCK_SIZE)
        assert two.blocks == one.blocks
        assert second.accepted == first.accepted and second.agreed == first.agreed
        assert second.tokens == greedy_generate(target, prompt, 16)


def test_a_seeded_dflash2_drafter_starts_from_the_dflash_drafter_of_its_seed(target):
    """Same seed, same DFlash weights (a DFlash and a DFlash 2 run are paired at step 0); the
    convs are the identity and the pair term 0 whatever the trainer's Linear init drew."""
    options = {"num_hidden_layers": 2, "num_target_features": 2, "block_size": BLOCK_SIZE,
               "mask_token_id": MASK_ID}  # fmt: skip
    dflash2 = DFlash2Drafter.from_target(target, sizes=SIZES, seed=5, **options)
    dflash = tiny_drafter(target, seed=5)
    state = dflash2.state_dict()
    assert all(torch.equal(state[k], v) for k, v in dflash.state_dict().items())
    for layer in dflash2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
            assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    assert not dflash2.candidate_selector.hidden_projection.weight.any()
    again = DFlash2Drafter.from_target(target, sizes=SIZES, seed=5, **options)
    other = DFlash2Drafter.from_target(target, sizes=SIZES, seed=6, **options)
    codebook = "candidate_selector.predecessor_codebook"
    assert torch.equal(again.state_dict()[codebook], state[codebook])
    assert not torch.equal(other.state_dict()[codebook], state[codebook])


def test_only_a_dflash_drafters_weights_upgrade(target):
    dflash = _trained_dflash(target)
    config = dflash2_config(dflash.config, SIZES)
    weights = dflash.state_dict()
    with pytest.raises(ValueError, match="unexpected.*extra"):
        DFlash2Drafter.from_dflash(config, {**weights, "extra": weights["fc.weight"]}, target)
    lacking = {k: v for k, v in weights.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match="missing.*norm.weight"):
        DFlash2Drafter.from_dflash(config, lacking, target)
    dflash2_weights = _upgraded(dflash, target).state_dict()
    with pytest.raises(ValueError, match="DFlash 2.s own"):
        DFlash2Drafter.from_dflash(config, dflash2_weights, target)


def test_training_leaves_the_dflash_point(target):
    """At the identity the selector's CE and the block CE still have gradients for every
    conv weight and for the selector's projection, so the new modules learn from step 0."""
    dflash2 = _upgraded(_trained_dflash(target), target)
    ids, features, docs, pos = packed_inputs(dflash2)
    hidden, tokens = packed_forward(dflash2, ids, features, docs, pos, ANCHORS, "two-part")
    real = ANCHORS >= 0
    hidden, tokens = hidden[real][:, 1:], tokens[real]
    preds = teacher_predecessors(tokens, BLOCK_SIZE)[:, 1:]
    gold = tokens[:, 1:]
    scores = dflash2.selector_scores(hidden.flatten(0, 1), preds.flatten(), gold.flatten())
    selector_ce = torch.nn.functional.cross_entropy(scores.scores, scores.gold_index)
    block_ce = torch.nn.functional.cross_entropy(
        dflash2.logits(hidden).flatten(0, 1), gold.flatten()
    )
    (selector_ce + block_ce).backward()
    for layer in dflash2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.base_kernel.grad.abs().sum() > 0
            assert conv.kernel_projection.weight.grad.abs().sum() > 0
    assert dflash2.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0
