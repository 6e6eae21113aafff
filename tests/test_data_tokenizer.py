"""Tokenizer: deterministic tiny BPE with chat template and <|MASK|>; adopting a given one."""

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash.config.schema import Config, TokenizerConfig
from dflash.data import conversations
from dflash.data import tokenizer as tok
from dflash.data.conversations import write_conversations
from dflash.data.tokenizer import INFO_FILE
from dflash.pipeline.workspace import Workspace
from dflash.stages import tokenizer as tokenizer_stage

TEXTS = [f"Hello number {i}, how are you doing today? I am fine, thanks." for i in range(50)]


@pytest.fixture(scope="module")
def tiny():
    return tok.train_tokenizer(TEXTS, 300)


def test_training_is_deterministic(tiny):
    again = tok.train_tokenizer(TEXTS, 300)
    assert again.backend_tokenizer.to_str() == tiny.backend_tokenizer.to_str()
    assert tok.tokenizer_hash(again) == tok.tokenizer_hash(tiny)


def test_special_tokens(tiny):
    assert len(tiny) <= 300
    assert tiny.eos_token == tok.IM_END and tiny.pad_token == tok.PAD_TOKEN
    for token in tok.SPECIAL_TOKENS:
        assert tiny.convert_tokens_to_ids(token) in tiny.all_special_ids
    mask_id = tiny.convert_tokens_to_ids(tok.MASK_TOKEN)
    assert tiny.encode(f"a{tok.MASK_TOKEN}b", add_special_tokens=False).count(mask_id) == 1


def test_chat_template_with_generation_prompt(tiny):
    messages = [{"role": "user", "content": "Hi"}]
    text = tiny.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_save_and_load_keep_everything(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    loaded = tok.load_tokenizer(tmp_path)
    assert tok.tokenizer_hash(loaded) == tok.tokenizer_hash(tiny)
    assert loaded.encode(TEXTS[3]) == tiny.encode(TEXTS[3])


def foreign_tokenizer(directory) -> None:
    """A fast tokenizer with a chat template but no <|MASK|>, like a real target's."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}"
    fast.save_pretrained(directory)


def test_load_adds_missing_mask_token(tmp_path):
    foreign_tokenizer(tmp_path)
    before = len(AutoTokenizer.from_pretrained(tmp_path, local_files_only=True))
    loaded = tok.load_tokenizer(tmp_path)
    assert len(loaded) == before + 1
    assert loaded.convert_tokens_to_ids(tok.MASK_TOKEN) == before
    assert not tok.add_mask_token(loaded)


def test_stage_records_an_adopted_tokenizer(tmp_path):
    foreign_tokenizer(tmp_path / "target_tok")
    ws = Workspace(tmp_path / "ws")
    tokenizer_stage.run(Config(tokenizer=TokenizerConfig(path=str(tmp_path / "target_tok"))), ws)
    info = json.loads((ws.tokenizer / INFO_FILE).read_text())
    assert info["mask_token_added"] is True and info["source"].endswith("target_tok")
    loaded = AutoTokenizer.from_pretrained(ws.tokenizer, local_files_only=True)
    assert loaded.convert_tokens_to_ids(tok.MASK_TOKEN) == info["mask_token_id"]
    assert tok.tokenizer_hash(loaded) == info["hash"]


def test_stage_trains_on_the_training_split(tmp_path):
    ws = Workspace(tmp_path)
    rows = [
        {
            "conversation_id": str(i),
            "messages": [
                {"role": "user", "content": text},
                {"role": "assistant", "content": text[::-1]},
            ],
        }
        for i, text in enumerate(TEXTS)
    ]
    ws.ingested.mkdir(parents=True)
    write_conversations(rows, ws.conversations)
    tokenizer_stage.run(Config(tokenizer=TokenizerConfig(vocab_size=300)), ws)
    info = json.loads((ws.tokenizer / INFO_FILE).read_text())
    assert info["source"] == "trained" and info["mask_token_added"] is False
    first = (ws.tokenizer / "tokenizer.json").read_bytes()
    shutil.rmtree(ws.tokenizer)
    tokenizer_stage.run(Config(tokenizer=TokenizerConfig(vocab_size=300)), ws)
    assert (ws.tokenizer / "tokenizer.json").read_bytes() == first
    assert tok.tokenizer_hash(tok.load_tokenizer(ws.tokenizer)) == info["hash"]


def test_corpus_is_read_one_row_group_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(conversations, "ROW_GROUP", 2)
    monkeypatch.setattr(tok, "ROW_GROUP", 2)
    call = {"type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}
    rows = [
        {"conversation_id": str(i), "messages": [{"role": "user", "content": f"u{i}"}]}
        for i in range(4)
    ]
    rows[3]["messages"].append({"role": "assistant", "content": "", "tool_calls": [call]})
    write_conversations(rows, tmp_path / "c.parquet")
    read = []
    monkeypatch.setattr(tok, "iter_batches", lambda *args: spy(read, *args))
    texts = tok.corpus_texts(tmp_path / "c.parquet")
    assert next(texts) == "u0" and len(read) == 1
    assert list(texts) == ["u1", "u2", "u3", "", "lookup", '{"q": 1}'] and len(read) == 2


def spy(read: list, *args):
    for batch in conversations.iter_batches(*args):
        read.append(len(batch))
        yield batch
