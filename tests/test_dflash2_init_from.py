"""``drafter.init_from`` with ``drafter.family: dflash2``: a DFlash checkpoint (this pipeline's
export, z-lab's layout, speculators') upgrades to a DFlash 2 drafter that computes its logits
and simulated τ; a DFlash 2 checkpoint (z-lab's layout, speculators') loads every weight, and
one with a weight missing or unknown is refused naming it."""

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import BLOCK_SIZE, MASK_ID
from safetensors.torch import load_file, save_file
from test_dflash2_metrics import _simulated
from test_dflash2_packed import (
    ANCHORS,
    SIZES,
    _randomize_dflash2_,
    make_dflash2,
    packed_forward,
    packed_inputs,
)
from test_dflash2_upgrade import _trained_dflash

from dflash.config.schema import DrafterConfig
from dflash.errors import ConfigError, UserError
from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.export import export_drafter
from dflash.train.init_drafter import build_drafter

TOKENIZER = SimpleNamespace(mask_token_id=MASK_ID, mask_token=None)
LAYOUTS = ("export", "z-lab", "speculators")


def _params(source: Path, family: str = "dflash2", **changes) -> DrafterConfig:
    return DrafterConfig(
        family=family, init_from=str(source), block_size=BLOCK_SIZE, num_hidden_layers=None,
        num_target_features=None, **(asdict(SIZES) | changes),
    )  # fmt: skip


def _write(directory: Path, drafter, target, layout: str) -> Path:
    """``drafter`` exported, then rewritten in ``layout``: z-lab's (the block size inside
    ``dflash_config``, no remote code) or speculators' (the layer config nested, the tapped
    layers counted from the embedding, the target's norm beside the drafter's weights)."""
    export_drafter(drafter, directory, target.config, torch.float32)
    if layout == "export":
        return directory
    config = json.loads((directory / "config.json").read_text())
    dflash = config.pop("dflash_config")
    config.pop("auto_map", None)
    block = config.pop("block_size", dflash.get("block_size"))
    if layout == "z-lab":
        config["dflash_config"] = dflash | {"block_size": block}
    else:
        sizes = {k: dflash[k] for k in asdict(SIZES) if k in dflash}  # DFlash 2: at the top
        config = sizes | {
            "speculators_model_type": "dflash2" if sizes else "dflash",
            "architectures": ["DFlash2DraftModel" if sizes else "DFlashSpeculator"],
            "transformer_layer_config": config, "block_size": block,
            "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
            "mask_token_id": dflash["mask_token_id"], "draft_vocab_size": config["vocab_size"],
        }  # fmt: skip
        weights = load_file(directory / "model.safetensors")
        weights["verifier_norm.weight"] = torch.ones(drafter.config.hidden_size)
        save_file(weights, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _logits(drafter) -> torch.Tensor:
    with torch.no_grad():
        hidden, _ = packed_forward(drafter, *packed_inputs(drafter), ANCHORS, "two-part")
        return drafter.logits(hidden[ANCHORS >= 0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dflash_checkpoint_upgrades_to_its_logits_and_simulated_tau(target, tmp_path, layout):
    dflash = _trained_dflash(target)
    source = _write(tmp_path / layout, dflash, target, layout)
    drafter, sources = build_drafter(_params(source), source, target, TOKENIZER, seed=0)
    drafter.eval()
    assert isinstance(drafter, DFlash2Drafter) and drafter.sizes() == SIZES
    assert sources["selector_rank"] == f"{SIZES.selector_rank} (params)"
    torch.testing.assert_close(_logits(drafter), _logits(dflash), atol=1e-5, rtol=0)
    simulated = _simulated(target, dflash)
    assert torch.equal(simulated.block_taus(drafter), simulated.block_taus(dflash))


@pytest.mark.parametrize("layout", ("z-lab", "speculators"))
def test_a_dflash2_checkpoint_loads_every_weight(target, tmp_path, layout):
    trained = _randomize_dflash2_(make_dflash2(target, transform=False), draw=5).eval()
    source = _write(tmp_path / layout, trained, target, layout)
    drafter, sources = build_drafter(_params(source), source, target, TOKENIZER, seed=9)
    drafter.eval()
    want, got = trained.state_dict(), drafter.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sources["selector_top_k"] == f"{SIZES.selector_top_k} (params = checkpoint)"
    assert isinstance(drafter, DFlash2Drafter) and drafter.sizes() == SIZES
    assert torch.equal(_logits(drafter), _logits(trained))


def _rewrite(source: Path, change) -> None:
    weights = load_file(source / "model.safetensors")
    change(weights)
    save_file(weights, source / "model.safetensors")


@pytest.mark.parametrize("layout", ("z-lab", "speculators"))
def test_a_dflash2_checkpoint_missing_or_adding_a_weight_is_refused(target, tmp_path, layout):
    trained = make_dflash2(target, transform=False)
    lacking = _write(tmp_path / "lacking", trained, target, layout)
    _rewrite(lacking, lambda w: w.pop("layers.1.mlp_conv.base_kernel"))
    with pytest.raises(ConfigError, match=r"lacks layers\.1\.mlp_conv\.base_kernel"):
        build_drafter(_params(lacking), lacking, target, TOKENIZER, seed=0)
    extra = _write(tmp_path / "extra", trained, target, layout)
    _rewrite(extra, lambda w: w.update({"candidate_selector.bias": torch.zeros(3)}))
    with pytest.raises(UserError, match=r"unknown weights candidate_selector\.bias"):
        build_drafter(_params(extra), extra, target, TOKENIZER, seed=0)


def test_z_labs_embedding_codebooks_load_as_the_bare_ones(target, tmp_path):
    """z-lab's modules hold the codebooks as ``nn.Embedding``: ``...codebook.weight``."""
    trained = _randomize_dflash2_(make_dflash2(target, transform=False), draw=6)
    source = _write(tmp_path / "zlab", trained, target, "z-lab")
    codebooks = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    _rewrite(source, lambda w: w.update({k + ".weight": w.pop(k) for k in codebooks}))
    drafter, _ = build_drafter(_params(source), source, target, TOKENIZER, seed=0)
    for name in codebooks:
        assert torch.equal(drafter.state_dict()[name], trained.state_dict()[name])


def test_a_dflash2_checkpoint_fixes_the_family_and_the_sizes(target, tmp_path):
    source = _write(tmp_path / "zlab", make_dflash2(target, transform=False), target, "z-lab")
    with pytest.raises(ConfigError, match="set drafter.family: dflash2"):
        build_drafter(_params(source, family="dflash"), source, target, TOKENIZER, seed=0)
    wrong = _params(source, selector_rank=SIZES.selector_rank + 1)
    with pytest.raises(ConfigError, match=f"selector_rank = {SIZES.selector_rank + 1} but"):
        build_drafter(wrong, source, target, TOKENIZER, seed=0)


def test_an_upgrade_refuses_sizes_that_cannot_work(target, tmp_path):
    source = _write(tmp_path / "export", _trained_dflash(target), target, "export")
    with pytest.raises(ConfigError, match="conv_group_size = 5 does not divide"):
        build_drafter(_params(source, conv_group_size=5), source, target, TOKENIZER, seed=0)
