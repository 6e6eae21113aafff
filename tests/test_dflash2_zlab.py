"""A DFlash 2 export loads in z-lab's own ``DFlash2DraftModel`` (their wheel's ``model.py``,
tests/zlab.py) with every weight used and none missing, drafts the same block there, and
decodes losslessly through z-lab's ``dflash_generate``, accepting what this project's decoding
accepts."""

import shutil
import time

import pytest
import torch
from conftest import run_stages
from test_dflash2_packed import MULTIPLIER, SOFTCAP, _randomize_dflash2_, make_dflash2
from zlab import reference_model

from dflash.config.params import load_config
from dflash.data.tokenizer import load_tokenizer
from dflash.eval.prompts import prompt_sets
from dflash.model.card import model_card
from dflash.model.dflash2_generate import SelectorProposer
from dflash.model.export import export_drafter
from dflash.model.families import load_drafter
from dflash.model.generate import greedy_decode, speculative_generate
from dflash.model.load import load_target
from dflash.pipeline.workspace import Workspace

TRAINED = [
    "drafter.family=dflash2",
    "drafter.conv_group_size=8",
    "data.regenerate=true",
    "regenerate.max_new_tokens=12",
    "train.world_size=1",
    "train.epochs=2",
]
"""A DFlash 2 drafter of the tiny workspace that learns the target's own answers, so its blocks
are accepted past the first token."""


def _export(drafter, target, directory):
    config = drafter.config_json(target.config, torch.float32)
    export_drafter(
        drafter, directory, target.config, torch.float32, model_card(config, "t", {}, {})
    )
    return directory


def _served(logits, transform: bool):
    """The served unary logits, written out: a multiplier, then a tanh softcap."""
    if not transform:
        return logits
    return torch.tanh(logits * MULTIPLIER / SOFTCAP) * SOFTCAP


@pytest.mark.parametrize("transform", [False, True], ids=["plain", "multiplier-softcap"])
def test_an_export_loads_in_z_labs_model_and_drafts_the_same_block(target, tmp_path, transform):
    drafter = _randomize_dflash2_(make_dflash2(target, transform=transform), draw=11)
    out = _export(drafter, target, tmp_path / "drafter")
    reference, info = reference_model().DFlash2DraftModel.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    bs, ctx = drafter.config.block_size, 6
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 299, (1, bs), generator=gen)
    features = torch.randn(1, ctx, drafter.fc.weight.shape[1], generator=gen)
    with torch.no_grad():
        hidden = drafter(ids, torch.arange(ctx, ctx + bs)[None], features, torch.arange(ctx)[None])
        theirs = reference.eval()(
            position_ids=torch.arange(ctx + bs)[None],
            noise_embedding=target.get_input_embeddings()(ids),
            target_hidden=features,
        )
        torch.testing.assert_close(
            reference.compute_logits(theirs[:, 1:], target.lm_head),
            _served(drafter.logits(hidden[:, 1:]), transform),
            atol=1e-5,
            rtol=0,
        )
        path, _, _ = reference.propose(theirs[:, 1:], ids[:, 0], target.lm_head, 0.0)
    assert torch.equal(path, drafter.walk(hidden, ids[:, 0]).tokens)


@pytest.mark.slow
def test_z_labs_dflash_generate_decodes_a_trained_export_losslessly(
    tiny_workspace_template, tmp_path, monkeypatch
):
    """A DFlash 2 drafter trained on the tiny target's own answers, as `train` exports it:
    z-lab's decoding gives the target's greedy tokens and accepts what this project's does,
    block by block (its stats time with CUDA's clock; on a CPU, with the plain one)."""
    ws = tmp_path / "ws"
    shutil.copytree(tiny_workspace_template, ws)
    run_stages(ws, ["regenerate", "tokenize", "stats", "plan", "train"], TRAINED)
    w = Workspace(ws)
    zlab = reference_model()
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    target = load_target(w.target).eval()
    drafter = load_drafter(w.drafter, target).eval()
    reference = zlab.DFlash2DraftModel.from_pretrained(w.drafter, dtype=torch.float32).eval()
    config = load_config(ws / "params.yaml", TRAINED)
    tokenizer = load_tokenizer(w.tokenizer)
    heldout = prompt_sets(config, tokenizer, w.heldout, (w.prompts, w.dvc_cache))[0]
    accepted = []
    for prompt in heldout.prompts[:3]:
        stats = zlab.dflash_generate(
            reference, target, torch.tensor([prompt.ids]), 12, None, return_stats=True
        )
        with torch.no_grad():
            greedy = greedy_decode(target, prompt.ids, 12)
            ours = speculative_generate(
                target, SelectorProposer(drafter), prompt.ids, 12, drafter.config.block_size
            )
        produced = stats.output_ids[0, len(prompt.ids) :].tolist()
        assert produced == greedy.tokens[: len(produced)] and len(produced) >= 12
        steps = stats.acceptance_lengths[:-1]  # the last is cut by each one's own length rule
        assert steps == ours.accepted[: len(steps)]
        accepted += steps
    assert max(accepted) > 1, accepted
