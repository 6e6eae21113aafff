"""Speculative decoding is lossless, a trained drafter gets accepted, and export round-trips."""

import json
import warnings

import pytest
import torch
from conftest import tiny_qwen3
from transformers import Qwen3ForCausalLM

from dflash.eval.lossless import classify
from dflash.eval.ngram import NgramProposer
from dflash.features.target_forward import target_features
from dflash.model.drafter import DFlashDrafter
from dflash.model.generate import dflash_generate, greedy_generate, speculative_generate
from dflash.model.objective import dflash_objective

BS = 4
MASK = 299
PROMPTS = [[5], [1, 2, 3], [40, 41, 42, 43, 44, 45], [7, 250, 7, 250, 7]]
TINY_TARGET = {"hidden_size": 48, "intermediate_size": 96}
"""The module's ``target`` (conftest.py): :func:`tiny_qwen3` of these keywords."""


def new_drafter(target, seed: int = 0) -> DFlashDrafter:
    return DFlashDrafter.from_target(
        target, block_size=BS, num_hidden_layers=1, num_target_features=3, mask_token_id=MASK,
        seed=seed,
    )  # fmt: skip


@pytest.fixture(scope="module")
def overfit(target) -> tuple[DFlashDrafter, list[int], float]:
    """A drafter trained on one of the target's own greedy continuations, and its accuracy."""
    torch.manual_seed(0)
    prompt = PROMPTS[1]
    sequence = prompt + greedy_generate(target, prompt, 28)
    T = len(sequence)
    ids = torch.tensor([sequence])
    pos = torch.arange(T)[None]
    docs = torch.zeros(1, T, dtype=torch.long)
    loss_mask = torch.ones(1, T, dtype=torch.long)
    anchors = torch.arange(T - BS + 1)[None]
    drafter = new_drafter(target)
    features = target_features(target, ids, pos, docs, drafter.config.target_layer_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(150):
        out = dflash_objective(drafter, features, ids, loss_mask, docs, pos, anchors, 7.0)
        optimizer.zero_grad()
        (out.loss_sum / out.weight_sum).backward()
        optimizer.step()
    with torch.no_grad():
        out = dflash_objective(drafter, features, ids, loss_mask, docs, pos, anchors, 7.0)
    return drafter.eval(), prompt, float(out.correct.sum() / out.counted.sum())


def test_tiny_drafter_overfits_one_sequence(overfit):
    _, _, accuracy = overfit
    assert accuracy > 0.9


@pytest.mark.parametrize("prompt", PROMPTS)
def test_random_drafter_is_lossless(target, prompt):
    drafter = new_drafter(target, seed=len(prompt))
    reference = greedy_generate(target, prompt, 24)
    out = dflash_generate(target, drafter, prompt, 24)
    assert out.tokens == reference
    assert len(out.tokens) == 24 == 1 + sum(out.accepted)


def test_overfit_drafter_is_lossless_and_accepted(target, overfit):
    drafter, prompt, _ = overfit
    for p in PROMPTS:
        assert dflash_generate(target, drafter, p, 24).tokens == greedy_generate(target, p, 24)
    out = dflash_generate(target, drafter, prompt, 24)
    tau = sum(out.accepted) / len(out.accepted)
    assert tau > 2.0, out.accepted  # training and inference agree on what a block sees


def test_the_cache_goes_by_the_keyword_the_target_takes(target):
    """transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in
    5.40); the decoders must not lean on the old name."""
    drafter = new_drafter(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        reference = greedy_generate(target, PROMPTS[0], 8)
        assert dflash_generate(target, drafter, PROMPTS[0], 8).tokens == reference


def test_budget_and_stop_tokens(target):
    drafter = new_drafter(target)
    prompt = PROMPTS[2]
    reference = greedy_generate(target, prompt, 30)
    stop = reference[9]
    first = reference.index(stop)
    out = dflash_generate(target, drafter, prompt, 30, stop_token_ids=[stop])
    assert out.tokens == reference[: first + 1]
    assert greedy_generate(target, prompt, 30, [stop]) == out.tokens
    for budget in (0, 1, 2, 5):
        assert dflash_generate(target, drafter, prompt, budget).tokens == reference[:budget]


def test_save_and_load_round_trip(target, overfit, tmp_path):
    drafter, prompt, _ = overfit
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == BS and config["num_hidden_layers"] == 1
    assert config["num_target_layers"] == target.config.num_hidden_layers
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 2, 3]}
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    for (name, a), (_, b) in zip(
        drafter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert dflash_generate(target, loaded, prompt, 16) == dflash_generate(
        target, drafter, prompt, 16
    )


def test_loading_against_the_wrong_target_is_refused(target, tmp_path):
    new_drafter(target).save_pretrained(tmp_path)
    other = tiny_qwen3(hidden_size=32)
    with pytest.raises(ValueError, match="hidden"):
        DFlashDrafter.from_pretrained(tmp_path, other)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_baseline_goes_through_the_same_lossless_verifier(target, prompt):
    reference = greedy_generate(target, prompt, 24)
    out = speculative_generate(target, NgramProposer(BS), prompt, 24, BS)
    assert out.tokens == reference
    assert len(out.tokens) == 1 + sum(out.accepted)


def test_steps_cut_by_the_budget_are_not_full_blocks(target):
    drafter = new_drafter(target)
    out = dflash_generate(target, drafter, PROMPTS[2], 3)  # 1 from the prefill, 2 to verify
    assert out.full == [False] * len(out.accepted)
    long = dflash_generate(target, drafter, PROMPTS[2], 24)
    assert long.full[0] is True and len(long.full) == len(long.accepted)
    assert long.decode_s > 0 and long.prefill_s > 0


def test_a_near_tie_is_told_apart_from_a_real_mismatch():
    """Two vocabulary rows made identical tie at every position: flipping one is rounding."""
    target = tiny_qwen3(hidden_size=48, intermediate_size=96, seed=3)
    prompt = PROMPTS[1]
    reference = greedy_generate(target, prompt, 8)
    favourite, twin = reference[2], (reference[2] + 1) % 300
    with torch.no_grad():
        target.lm_head.weight[twin] = target.lm_head.weight[favourite]
    reference = greedy_generate(target, prompt, 8)
    assert reference[2] == favourite  # ties resolve to the lower index; the twin is not it
    flipped = reference[:2] + [twin] + reference[3:]
    verdict, margin = classify(target, prompt, reference, flipped, near_tie=1e-4)
    assert verdict == "near_tie" and margin == pytest.approx(0.0, abs=1e-5)
    wrong = reference[:2] + [(favourite + 7) % 300] + reference[3:]
    verdict, margin = classify(target, prompt, reference, wrong, near_tie=1e-4)
    assert (verdict, classify(target, prompt, reference, reference, 1e-4)[0]) == (
        "mismatch",
        "same",
    )


def bf16_target(seed: int, top_logit: float = 25.0) -> Qwen3ForCausalLM:
    """A bf16 tiny target whose head is scaled so its top logits are a real LLM's size (~25)."""
    target = tiny_qwen3(hidden_size=64, intermediate_size=128, seed=seed).to(torch.bfloat16)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=torch.tensor([PROMPTS[1]])).last_hidden_state
        top = target.lm_head(hidden).float().max()
        target.lm_head.weight.mul_(top_logit / float(top))
    return target


@pytest.mark.parametrize("seed", [1, 3])
def test_a_bf16_target_shows_no_false_mismatches(seed):
    """Speculative decoding is lossless in exact arithmetic: every bf16 divergence is rounding."""
    target = bf16_target(seed)
    drafter = new_drafter(target, seed=seed)
    verdicts = []
    for prompt in PROMPTS:
        reference = greedy_generate(target, prompt, 32)
        spec = dflash_generate(target, drafter, prompt, 32).tokens
        verdicts.append(classify(target, prompt, reference, spec, near_tie=0.05)[0])
    assert "mismatch" not in verdicts, verdicts


def test_bf16_margins_are_finer_than_a_bf16_logit_step():
    """Two head rows 0.01-0.05 apart in fp32 round to one bf16 logit, or to two a step apart."""
    target = tiny_qwen3(hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    prompt = PROMPTS[1]
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
    hidden = hidden.float()
    k = int(hidden.abs().argmax())
    favourite, twin = 10, 11
    steps, margins = [], []
    for i in range(12):
        with torch.no_grad():
            row = hidden / hidden.norm() * ((20 + 0.011 * i) / hidden.norm())
            target.lm_head.weight[favourite] = row
            nudged = target.lm_head.weight[favourite].clone()
            nudged[k] -= (0.02 + 0.0015 * i) / hidden[k]
            target.lm_head.weight[twin] = nudged
            logits = target(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
            exact = target.lm_head.weight[[favourite, twin]].float() @ hidden
        reference = greedy_generate(target, prompt, 3)
        assert reference[0] == favourite
        verdict, margin = classify(target, prompt, reference, [twin] + reference[1:], 0.05)
        assert verdict == "near_tie" and margin == pytest.approx(
            float(exact[0] - exact[1]), abs=1e-5
        )
        steps.append(float(logits[favourite] - logits[twin]))
        margins.append(margin)
    assert all(0 < m < 0.05 for m in margins)
    assert max(steps) == 0.125  # what the bf16 logits showed: a whole step, above 0.05


def test_a_clear_bf16_mismatch_is_still_one():
    target, prompt = bf16_target(0), PROMPTS[1]
    reference = greedy_generate(target, prompt, 4)
    logits = target(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].float()
    worst = int(logits.argmin())  # a bug's token, some 50 logits below greedy
    verdict, margin = classify(target, prompt, reference, [worst] + reference[1:], 0.05)
    assert verdict == "mismatch" and margin > 1.0
