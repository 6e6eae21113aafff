"""The drafter export carries what z-lab's reference, SGLang and vLLM read, in the run dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen3
from safetensors import safe_open
from transformers import Qwen3Config

from dflash.model.drafter import DFlashDrafter
from dflash.model.export import export_drafter, loader_notes

FIXTURE = Path(__file__).parent / "fixtures" / "zlab_qwen3_8b_dflash_b16_config.json"
"""The keys of z-lab's public Qwen3-8B-DFlash-b16 ``config.json``, written by hand from it."""


def drafter_for(target, layers: int = 1, features: int = 3) -> DFlashDrafter:
    return DFlashDrafter.from_target(
        target, block_size=4, num_hidden_layers=layers, num_target_features=features,
        mask_token_id=299,
    )  # fmt: skip


@pytest.fixture(scope="module")
def target():
    model = tiny_qwen3()
    model.config.max_position_embeddings = 512
    return model


def test_config_has_every_key_of_the_public_zlab_config(target, tmp_path):
    export_drafter(drafter_for(target), tmp_path / "drafter", target.config)
    ours = json.loads((tmp_path / "drafter/config.json").read_text())
    public = json.loads(FIXTURE.read_text())
    assert sorted(set(public) - set(ours)) == []
    assert set(public["dflash_config"]) <= set(ours["dflash_config"])
    assert ours["max_position_embeddings"] == 512
    assert ours["rope_parameters"]["rope_theta"] == ours["rope_theta"]
    assert ours["dtype"] == ours["torch_dtype"] == "float32"
    assert ours["layer_types"] == ["full_attention"]
    # vLLM counts the embedding as layer 0: its aux ids are DFlash's target layers + 1.
    assert ours["eagle_aux_hidden_state_layer_ids"] == [
        i + 1 for i in ours["dflash_config"]["target_layer_ids"]
    ]
    # The reference builds a Qwen3Config from the file: every key must be one it accepts.
    config = Qwen3Config(**ours)
    assert config.num_hidden_layers == 1 and config.max_position_embeddings == 512


def test_weights_are_saved_in_the_dtype_the_target_runs_in(tmp_path):
    target = tiny_qwen3().to(torch.bfloat16)
    drafter = drafter_for(target)
    drafter.save_pretrained(tmp_path, target.config)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.fc.weight.dtype == torch.float32  # trained and run in fp32, as before


def test_export_names_the_loaders_that_need_target_layer_ids(target, tmp_path, capsys):
    export_drafter(drafter_for(target, layers=1, features=3), tmp_path / "a", target.config)
    assert "eagle_aux_hidden_state_layer_ids" in capsys.readouterr().out
    assert loader_notes(drafter_for(target, layers=2, features=2).config) == []
