"""Evaluation of a DFlash 2 drafter: decoding walks the selector from the anchor, losslessly,
and the untrained baseline is a DFlash 2 drafter of the same sizes at initialisation."""

import torch
from test_dflash2_packed import _randomize_dflash2_, make_dflash2

from dflash.eval.evaluate import decode_all, proposer, untrained_drafter
from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.dflash2_generate import SelectorProposer
from dflash.model.drafter import DFlashDrafter


def test_a_dflash2_drafter_decodes_by_its_walk_losslessly(target):
    drafter = _randomize_dflash2_(make_dflash2(target, transform=False), draw=9)
    untrained = untrained_drafter(drafter, target, seed=0)
    assert isinstance(untrained, DFlash2Drafter) and untrained.sizes() == drafter.sizes()
    proposers = {"dflash": proposer(drafter), "untrained": proposer(untrained)}
    assert all(isinstance(p, SelectorProposer) for p in proposers.values())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 299, (n,), generator=gen).tolist() for n in (5, 9, 12)]
    with torch.no_grad():
        decodes = decode_all(target, proposers, prompts, 10, 1e-3, [], 4)
    for name in proposers:
        assert decodes.verdicts[name] == ["same"] * len(prompts), name
        assert all(
            o.tokens == g.tokens for o, g in zip(decodes.methods[name], decodes.greedy, strict=True)
        )


def test_the_untrained_baseline_keeps_the_drafters_windows_causality_and_mask_token(target):
    """A drafter trained with sliding layers and causal blocks is compared with the drafter
    training started from: the same attention in every layer, the same weights."""
    options = dict(block_size=4, num_hidden_layers=2, num_target_features=2, mask_token_id=5)
    windows = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    started = DFlashDrafter.from_target(
        target, **options, **windows, causal=True, mask_token="<|MASK|>", seed=7
    )
    untrained = untrained_drafter(started, target, seed=7)
    for layer in range(2):
        rule = untrained.config.attention_rule(layer)
        assert rule == started.config.attention_rule(layer) == ((3, True), (None, True))[layer]
    assert untrained.config.mask_token == "<|MASK|>"
    for name, value in started.state_dict().items():
        assert torch.equal(value, untrained.state_dict()[name]), name
