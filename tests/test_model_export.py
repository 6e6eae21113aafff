"""The drafter export carries what z-lab's reference, SGLang and vLLM read, in the run dtype."""

from __future__ import annotations

import ast
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_drafts_losslessly, tiny_drafter, tiny_qwen3
from safetensors import safe_open
from transformers import AutoModel, Qwen3Config

from dflash.data.tokenizer import train_tokenizer
from dflash.model.card import model_card
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import (
    config_json,
    export_drafter,
    export_dtype,
    loader_notes,
    read_config,
)

FIXTURE = Path(__file__).parent / "fixtures" / "zlab_qwen3_8b_dflash_b16_config.json"
"""The keys of z-lab's public Qwen3-8B-DFlash-b16 ``config.json``, written by hand from it."""
TINY_TARGET = {"num_hidden_layers": 6, "max_position_embeddings": 512}
"""The module's ``target`` (conftest.py): :func:`tiny_qwen3` of these keywords."""


def test_config_has_every_key_of_the_public_zlab_config(target, tmp_path):
    export_drafter(tiny_drafter(target, 1, 3), tmp_path / "drafter", target.config)
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
    drafter = tiny_drafter(target, 1, 3)
    drafter.save_pretrained(tmp_path, target.config)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = DFlashDrafter.from_pretrained(tmp_path, target)
    assert loaded.fc.weight.dtype == torch.float32  # trained and run in fp32, as before


def test_config_reads_back_as_built_and_refuses_missing_keys(target):
    drafter = tiny_drafter(target, 1, 3)
    data = config_json(drafter.config, target.config)
    assert read_config(data) == drafter.config
    del data["head_dim"], data["dflash_config"]["target_layer_ids"]
    with pytest.raises(ValueError, match=r"lacks \['head_dim', 'target_layer_ids'\]"):
        read_config(data)


def test_export_names_the_loaders_that_need_target_layer_ids(target, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash")
    export_drafter(tiny_drafter(target, 1, 3), tmp_path / "a", target.config)
    assert "eagle_aux_hidden_state_layer_ids" in caplog.text
    assert loader_notes(tiny_drafter(target).config) == []


def imported_packages(path: Path) -> set[str]:
    nodes = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom)
    ]
    names = [a.name for n in nodes if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in nodes if isinstance(n, ast.ImportFrom)]
    return {name.split(".")[0] for name in names}


@pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")
def test_export_loads_through_automodel_and_decodes_losslessly(target, tmp_path, hub_modules):
    drafter = tiny_drafter(target, 2, 3, mask_token="<|MASK|>", seed=1)
    export_drafter(drafter, tmp_path / "drafter", target.config)
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["dflash_config"]["mask_token"] == "<|MASK|>"
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel"}
    code = (tmp_path / "drafter" / config["auto_map"]["AutoModel"].split(".")[0]).with_suffix(".py")
    assert imported_packages(code) == {"__future__", "inspect", "torch", "transformers"}

    model = AutoModel.from_pretrained(
        tmp_path / "drafter", trust_remote_code=True, local_files_only=True
    ).eval()
    assert type(model).__name__ == "DFlashDraftModel"
    # One definition: the shipped config class, as AutoConfig loads it, is the trainer's.
    assert type(model.config).__name__ == type(drafter.config).__name__
    assert config_json(model.config, target.config) == config_json(drafter.config, target.config)
    ours = dict(drafter.state_dict())
    assert ours.keys() == dict(model.state_dict()).keys()
    # The same hidden states as the trainer's drafter, so the same drafts.
    torch.manual_seed(0)
    features, block = torch.randn(1, 7, 3 * 32), torch.randint(0, 300, (1, 4))
    positions = torch.arange(11)[None]
    with torch.no_grad():
        theirs = model(target.get_input_embeddings()(block), features, positions)
        mine = drafter(block, positions[:, 7:], features, positions[:, :7])
    torch.testing.assert_close(theirs, mine)
    assert_drafts_losslessly(model, target, stop=True)


def test_export_dtype_auto_is_the_dtype_the_target_config_serves_in(tmp_path):
    tiny_qwen3().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tiny_qwen3().save_pretrained(tmp_path / "fp32")
    assert export_dtype("auto", tmp_path / "bf16") == torch.bfloat16
    assert export_dtype("auto", tmp_path / "fp32") == torch.float32
    assert export_dtype("float16", tmp_path / "bf16") == torch.float16
    target = tiny_qwen3()  # runs in fp32 here, as the CPU default does; the export follows dtype
    tiny_drafter(target, 1, 3).save_pretrained(tmp_path / "out", target.config, torch.bfloat16)
    assert json.loads((tmp_path / "out/config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_model_card_says_how_to_serve_and_what_trained_it(target):
    config = config_json(tiny_drafter(target, 1, 3).config, target.config, torch.bfloat16)
    params = {"drafter": {"block_size": 4}, "train": {"lr": 0.003}}
    training = {"final_loss": 0.77, "steps": 462, "train_seconds": 61.5, "tokens_per_s": 9e3}
    card = model_card(config, "Qwen/Qwen3-8B", params, training)
    assert "train_seconds" not in card and "tokens_per_s" not in card  # same run, same card
    spec = '{"method": "dflash", "model": ".", "num_speculative_tokens": 3}'
    assert "TARGET=Qwen/Qwen3-8B  #" in card and 'TARGET = "Qwen/Qwen3-8B"  #' in card
    assert f"vllm serve \"$TARGET\" \\\n  --speculative-config '{spec}'" in card
    for flag in ("--speculative-algorithm DFLASH", "--speculative-draft-model-path .",
                 "--speculative-num-draft-tokens 4", "trust_remote_code=True"):  # fmt: skip
        assert flag in card
    assert "lr: 0.003" in card and "| final_loss | 0.77 |" in card and "bfloat16" in card
    scored = model_card(config, "t", params, {}, {"acceptance_length": 4.1027, "baselines": {
        "ngram": {"acceptance_length": 1.2568}}})  # fmt: skip
    assert "| 4.103 |" in scored and "| τ of n-gram prompt lookup | 1.257 |" in scored


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_cards_snippet_runs_from_a_fresh_export(tmp_path, hub_modules, monkeypatch, umask_022):
    texts = ["the cat sat on the mat", "a dog ran to the big red log"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    target = tiny_qwen3(vocab_size=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target, 1, 3, mask_token_id=tokenizer.mask_token_id)
    config = config_json(drafter.config, target.config, torch.float32)
    params = {"data": {"source": "my/chats.jsonl"}, "drafter": {"block_size": 4}}
    card = model_card(config, "models/target", params, {"final_loss": 1.0})
    assert "`my/chats.jsonl` (`data.source`)" in card and "source: my/chats.jsonl" in card
    out = tmp_path / "published"
    export_drafter(drafter, out, target.config, card=card)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        name: 0o644 for name in ("config.json", "model.safetensors", "dflash.py", "README.md")
    }
    snippet = re.search(r"Transformers.*?```python\n(.*?)```", card, re.S).group(1)
    top = 'TARGET = "models/target"  #'
    assert top in snippet
    snippet = snippet.replace('"models/target"', repr(str(tmp_path / "target")), 1)
    monkeypatch.chdir(out)
    exec(compile(snippet, "card", "exec"), {})
