"""A DFlash 2 export: ``DFlash2DraftModel`` with its sizes under ``dflash_config``, weights in
the engines' layout, no DFlash remote code, a card that says so, and a reload to the same
logits and walk."""

import json

import torch
from safetensors.torch import load_file
from test_dflash2_packed import SIZES, _randomize_dflash2_, make_dflash2

from dflash.model import hf_files
from dflash.model.card import model_card
from dflash.model.dflash2_weights import dflash2_shapes
from dflash.model.export import export_drafter
from dflash.model.families import load_drafter


def test_an_export_names_dflash2_and_reloads_to_the_same_drafter(target, tmp_path):
    drafter = _randomize_dflash2_(make_dflash2(target), draw=8)
    out = tmp_path / "drafter"
    config = drafter.config_json(target.config, torch.float32)
    card = model_card(config, "models/target", {}, {})
    export_drafter(drafter, out, target.config, torch.float32, card)

    data = json.loads((out / hf_files.CONFIG).read_text())
    assert data["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in data
    served = data["dflash_config"]
    assert served["block_size"] == drafter.config.block_size
    assert served["target_layer_ids"] == drafter.config.target_layer_ids
    assert served["mask_token_id"] == drafter.config.mask_token_id
    for key, value in SIZES.__dict__.items():
        assert served[key] == value, key
    assert not (out / hf_files.REMOTE_CODE).exists()
    weights = load_file(out / hf_files.WEIGHTS)
    for name, shape in dflash2_shapes(drafter.config).items():
        assert tuple(weights[name].shape) == shape, name
    assert set(weights) == set(drafter.state_dict())
    assert "# DFlash 2 drafter" in card and "rank-6 selector" in card

    loaded = load_drafter(out, target)
    assert type(loaded) is type(drafter) and loaded.unary_transform() == drafter.unary_transform()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 299, (1, 4), generator=gen)
    features = torch.randn(1, 6, drafter.fc.weight.shape[1], generator=gen)
    inputs = (ids, torch.arange(6, 10)[None], features, torch.arange(6)[None])
    with torch.no_grad():
        hidden, again = drafter(*inputs), loaded(*inputs)
        torch.testing.assert_close(loaded.logits(again), drafter.logits(hidden), atol=1e-6, rtol=0)
        assert torch.equal(
            loaded.walk(again, ids[:, 0]).tokens, drafter.walk(hidden, ids[:, 0]).tokens
        )
