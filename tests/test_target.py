"""The target stage: the tiny default is pretrained and saved, a real path is only referenced."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_stages
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from dflash.data.tokenizer import load_tokenizer
from dflash.model.load import load_target
from dflash.model.pretrain import IGNORE, encode_windows, pack
from dflash.model.target_dir import TARGET_REFERENCE, resolve_target_path
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

PRETRAIN = ["target.pretrain_epochs=3", "target.pretrain_batch_tokens=384"]


@pytest.fixture
def pretrained(tiny_workspace):
    run_stages(tiny_workspace, ["target"], PRETRAIN)
    return tiny_workspace


def test_pretrained_target_is_a_hf_dir_with_metrics(pretrained):
    target = pretrained / WS.target
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in target.iterdir()
    }
    metrics = json.loads((pretrained / WS.target_details).read_text())
    assert metrics["mode"] == "pretrained"
    assert metrics["train_loss"] < metrics["first_loss"] - 1.0
    assert metrics["heldout_perplexity"] == pytest.approx(math.exp(metrics["heldout_loss"]))
    assert metrics["heldout_tokens"] > 0 and metrics["train_tokens"] > 0
    model = load_target(target)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.vocab_size == len(load_tokenizer(pretrained / WS.tokenizer))


def test_pretraining_is_seeded(pretrained):
    first = load_file(pretrained / WS.target / "model.safetensors")
    run_stages(pretrained, ["target"], PRETRAIN)
    second = load_file(pretrained / WS.target / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_load_target_is_frozen_eval_fp32_on_cpu(tiny_workspace):
    model = load_target(tiny_workspace / WS.target, "cpu")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_reference_mode_records_the_path_and_copies_no_weights(tiny_workspace, tmp_path):
    real = tmp_path / "real-target"
    (tiny_workspace / WS.target).rename(real)
    run_stages(tiny_workspace, ["target"], [f"target.path={real}"])
    target = tiny_workspace / WS.target
    assert [p.name for p in target.iterdir()] == [TARGET_REFERENCE]
    reference = json.loads((target / TARGET_REFERENCE).read_text())
    assert reference["path"] == str(real.resolve())
    assert len(reference["config_sha256"]) == 64
    assert resolve_target_path(target) == str(real.resolve())
    metrics = json.loads((tiny_workspace / WS.target_details).read_text())
    assert metrics["mode"] == "reference" and metrics["heldout_loss"] > 0
    via_reference, direct = load_target(target), load_target(real)
    assert not any(p.requires_grad for p in via_reference.parameters())
    for a, b in zip(via_reference.parameters(), direct.parameters(), strict=True):
        assert torch.equal(a, b)


def test_reference_mode_rejects_a_target_missing_tokenizer_ids(tiny_workspace, tmp_path):
    small = load_target(tiny_workspace / WS.target)
    small.resize_token_embeddings(8)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="vocabulary 8 is smaller than the tokenizer"):
        run_stages(tiny_workspace, ["target"], [f"target.path={tmp_path / 'small'}"])


def test_pack_cuts_the_stream_into_rows_and_ignores_the_tail():
    input_ids, labels = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4, pad_id=0)
    assert input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert labels.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, IGNORE, IGNORE, IGNORE]]
    with pytest.raises(ValueError, match="zero tokens"):
        pack([[], []], seq_len=4, pad_id=0)


def test_encode_windows_keeps_the_head_and_counts_the_cut(tiny_workspace):
    tokenizer = load_tokenizer(tiny_workspace / WS.tokenizer)
    messages = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    documents, cut = encode_windows([{"messages": messages}], tokenizer, max_seq_len=5)
    assert documents == [full[:5]] and cut == len(full) - 5
    assert encode_windows([], tokenizer, max_seq_len=5) == ([], 0)
