"""drafter.mask_token: draft with a target's reserved token instead of appending <|MASK|>.

A target with no spare embedding rows (Llama-3.1: 128,256 tokens and 128,256 rows) cannot take
a new token; its reserved special tokens never appear in text and can fill the blocks instead.
"""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash.config.params import load_config
from dflash.config.schema import Config, DrafterConfig, TokenizerConfig
from dflash.data import tokenizer as tok
from dflash.data.tokenizer import INFO_FILE
from dflash.errors import ConfigError
from dflash.pipeline.workspace import Workspace
from dflash.stages import tokenizer as tokenizer_stage

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

RESERVED = "<|reserved_special_token_0|>"


def reserved_tokenizer(directory) -> int:
    """A target-like tokenizer whose vocabulary is full, with one reserved special token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["</s>", RESERVED],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([f"hello number {i}, how are you" for i in range(40)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    fast.save_pretrained(directory)
    return len(fast)


def adopt(tmp_path, monkeypatch, mask_token):
    size = reserved_tokenizer(tmp_path / "target_tok")
    monkeypatch.chdir(tmp_path)
    config = Config(
        tokenizer=TokenizerConfig(path=str(tmp_path / "target_tok")),
        drafter=DrafterConfig(mask_token=mask_token),
    )
    tokenizer_stage.run(config, WS)
    return size


def test_a_reserved_token_is_used_and_nothing_is_appended(tmp_path, monkeypatch):
    size = adopt(tmp_path, monkeypatch, RESERVED)
    info = json.loads((WS.tokenizer / INFO_FILE).read_text())
    loaded = tok.load_tokenizer(WS.tokenizer)
    assert len(loaded) == size == info["vocab_size"]
    assert info["mask_token"] == RESERVED and info["mask_token_added"] is False
    assert loaded.mask_token_id == info["mask_token_id"] == loaded.convert_tokens_to_ids(RESERVED)
    assert tok.MASK_TOKEN not in loaded.get_vocab()


def test_without_it_mask_is_appended_as_before(tmp_path, monkeypatch):
    size = adopt(tmp_path, monkeypatch, None)
    loaded = tok.load_tokenizer(WS.tokenizer)
    assert len(loaded) == size + 1 and loaded.mask_token == tok.MASK_TOKEN


@pytest.mark.parametrize("bad", ["<|not_a_token|>", "</s>"])
def test_a_token_outside_the_vocab_or_in_use_is_refused(tmp_path, monkeypatch, bad):
    with pytest.raises(ValueError, match="drafter.mask_token"):
        adopt(tmp_path, monkeypatch, bad)


def test_an_empty_name_is_a_config_error():
    with pytest.raises(ConfigError, match="drafter.mask_token"):
        load_config(None, ["drafter.mask_token=''"])
