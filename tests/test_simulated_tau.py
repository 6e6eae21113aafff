"""Simulated τ during training: SpecForge's rule on a fixed held-out batch, deterministic."""

from __future__ import annotations

import os

import pytest
import torch

from dflash.data.tokenizer import load_tokenizer
from dflash.model.drafter import DFlashDrafter
from dflash.model.generate import greedy_generate
from dflash.model.load import load_target
from dflash.pipeline.workspace import Workspace
from dflash.train.simulated import NEW_TOKENS, SimulatedTau, answer, through_first_stop

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

NO_AUTOCAST = torch.autocast("cpu", enabled=False)


@pytest.fixture(scope="module")
def built(tiny_workspace_template):
    """Built once from the shared workspace, which it only reads."""
    cwd = os.getcwd()
    os.chdir(tiny_workspace_template)
    try:
        target, tokenizer = load_target(WS.target, "cpu"), load_tokenizer(WS.tokenizer)
        drafter = DFlashDrafter.from_target(
            target, block_size=4, num_hidden_layers=1, num_target_features=2,
            mask_token_id=tokenizer.mask_token_id, seed=3,
        )  # fmt: skip
        simulated = SimulatedTau.build(WS.heldout, target, tokenizer, drafter, 96, NO_AUTOCAST, {})
        yield target, tokenizer, drafter, simulated
    finally:
        os.chdir(cwd)


@torch.no_grad()
def decoded_alone(simulated: SimulatedTau, drafter: DFlashDrafter, index: int) -> int:
    """One block as generation drafts it: only its document's context before the anchor."""
    bs, anchor = drafter.config.block_size, int(simulated.anchors[index])
    docs = simulated.document_ids[0]
    start = int(torch.nonzero(docs == docs[anchor])[0, 0])
    block = slice(index * bs, (index + 1) * bs)
    hidden = drafter(
        simulated.block_ids[:, block], simulated.block_positions[:, block],
        simulated.features[:, start:anchor], simulated.context_positions[:, start:anchor],
    )  # fmt: skip
    hits = (drafter.logits(hidden[0]).argmax(-1) == simulated.labels[index]) & simulated.counts[
        index
    ]
    return 1 + int(hits[1:].long().cumprod(0).sum())


def test_block_tau_is_what_decoding_each_block_alone_accepts(built):
    _, _, drafter, simulated = built
    taus = simulated.block_taus(drafter)
    assert len(taus) == len(simulated.anchors) > 20
    for index in range(0, len(taus), 5):
        assert int(taus[index]) == decoded_alone(simulated, drafter, index), index
    # Every block has a label after its anchor, inside the target's own greedy answer.
    assert simulated.counts[:, 1].all() and not simulated.counts[:, 0].any()


def test_simulated_tau_is_deterministic_and_in_range(built, tiny_workspace_template, monkeypatch):
    target, tokenizer, drafter, simulated = built
    monkeypatch.chdir(tiny_workspace_template)
    again = SimulatedTau.build(WS.heldout, target, tokenizer, drafter, 96, NO_AUTOCAST, {})
    assert simulated.measure(drafter) == again.measure(drafter) == simulated.measure(drafter)
    assert 1.0 <= simulated.measure(drafter) <= drafter.config.block_size
    assert simulated.seconds > 0


def test_answers_run_the_whole_budget_and_match_a_stopping_decode(built):
    """Every rank runs ``NEW_TOKENS`` forwards (FSDP gathers in each), whatever token stops."""
    target = built[0]
    prompt = [5, 17, 42, 9]
    free = greedy_generate(target, prompt, NEW_TOKENS)
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for stop in (free[0], free[NEW_TOKENS // 2], -1):
            forwards.clear()
            got = answer(target, prompt, {stop})
            assert len(forwards) == NEW_TOKENS
            assert got == greedy_generate(target, prompt, NEW_TOKENS, [stop])
    finally:
        hook.remove()
    assert through_first_stop([4, 2, 7, 2], {2}) == [4, 2]
    assert through_first_stop([4, 2, 7], {9}) == [4, 2, 7]
