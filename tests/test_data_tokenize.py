"""Tokenize: assistant-only loss mask for any template, length policy, the token store."""

import json
import logging
import pickle

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.config.schema import (
    Config,
    DataConfig,
    DrafterConfig,
    EvaluateConfig,
    RegenerateConfig,
    TokenizerConfig,
)
from dflash.data import tokenize, tokenizer
from dflash.data.chat import ChatTemplateError, encode_conversation, encode_conversations
from dflash.data.conversations import SCHEMA
from dflash.data.store import TokenStore, TokenStoreWriter
from dflash.data.tokenizer import INFO_FILE
from dflash.pipeline.workspace import Workspace
from dflash.stages import ingest as ingest_stage
from dflash.stages import tokenize as tokenize_stage
from dflash.stages import tokenizer as tokenizer_stage

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How are you?"},
    {"role": "user", "content": "fine"},
    {"role": "assistant", "content": " spaced  out\nreply "},
]
ASSISTANT = [m["content"] for m in CHAT if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def tiny():
    texts = [m["content"] for m in CHAT] * 5 + ["the quick brown fox jumps over the lazy dog"] * 5
    return tokenizer.train_tokenizer(texts, 300)


def masked_text(tok, ids: np.ndarray, mask: np.ndarray) -> str:
    return tok.decode(ids[mask == 1].tolist())


def test_masked_tokens_are_exactly_the_assistant_contents(tiny):
    ids, mask = encode_conversation(tiny, CHAT)
    assert ids.dtype == np.uint32 and mask.dtype == np.uint8 and len(ids) == len(mask)
    assert masked_text(tiny, ids, mask) == "".join(c + tokenizer.IM_END for c in ASSISTANT)
    assert tiny.decode(ids.tolist()) == tiny.apply_chat_template(CHAT, tokenize=False)


WORD = st.text(alphabet="abcdefgh!?é€", min_size=1, max_size=6)
CONTENT = st.lists(WORD, min_size=1, max_size=6).map(" ".join)
TURN = st.tuples(st.sampled_from(["user", "assistant"]), CONTENT)


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(TURN, min_size=1, max_size=6), system=st.none() | CONTENT)
def test_mask_matches_assistant_contents_for_any_turn_structure(tiny, turns, system):
    messages = [{"role": role, "content": content} for role, content in turns]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    ids, mask = encode_conversation(tiny, messages)
    expected = "".join(
        m["content"] + tokenizer.IM_END for m in messages if m["role"] == "assistant"
    )
    assert masked_text(tiny, ids, mask) == expected


def test_mask_is_found_for_a_foreign_template(tiny):
    """Trimmed contents, an injected system prompt that repeats assistant words, and a
    generation prompt that is not a prefix of the rendered chat (as with Qwen3 thinking)."""
    tiny.chat_template = (
        "{{ bos_token }}{% if messages[0]['role'] != 'system' %}SYSTEM: fine Hello{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]\n\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n\n<think></think>{% endif %}"
    )
    try:
        ids, mask = encode_conversation(tiny, CHAT[1:])
    finally:
        tiny.chat_template = tokenizer.CHAT_TEMPLATE
    expected = "".join(c.strip() + tokenizer.IM_END for c in ASSISTANT)
    assert masked_text(tiny, ids, mask) == expected


def test_template_that_rewrites_content_is_an_error(tiny):
    tiny.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    try:
        with pytest.raises(ChatTemplateError, match="assistant message 2"):
            encode_conversation(tiny, CHAT)
    finally:
        tiny.chat_template = tokenizer.CHAT_TEMPLATE


def test_truncated_encoding_is_a_prefix_of_the_full_one(tiny):
    ids, mask = encode_conversation(tiny, CHAT)
    for cut in (1, 20, len(ids) - 3, len(ids)):
        short_ids, short_mask = encode_conversation(tiny, CHAT, max_tokens=cut)
        assert np.array_equal(short_ids, ids[:cut]) and np.array_equal(short_mask, mask[:cut])


def rows(n: int) -> list[dict]:
    chats = []
    for i in range(n):
        answer = "word " * (1 + 7 * i)
        chats.append(
            {
                "conversation_id": f"c{i}",
                "messages": [*CHAT[1:4], {"role": "assistant", "content": answer}],
            }
        )
    return chats


def batches(rows_: list[dict], size: int) -> list[pa.RecordBatch]:
    return [
        pa.RecordBatch.from_pylist(rows_[i : i + size], schema=SCHEMA)
        for i in range(0, len(rows_), size)
    ]


def write_store(
    tok, directory, max_seq_len=200, overlength="truncate", min_loss=8, chunk=3, workers=1
):
    writer = TokenStoreWriter(directory)
    policy = tokenize.Policy(max_seq_len, overlength, min_loss)
    counts = tokenize.tokenize_chunks(batches(rows(10), chunk), tok, writer, policy, workers)
    return writer.close(counts)


def test_length_policy_counts_every_sample(tiny, tmp_path):
    full = [len(ids) for ids, _ in encode_conversations(tiny, [r["messages"] for r in rows(10)])]
    over = sum(n > 200 for n in full)
    assert 0 < over < 10
    kept = write_store(tiny, tmp_path / "t", overlength="truncate")
    assert kept["truncated"] == over and kept["n_samples"] == 10
    dropped = write_store(tiny, tmp_path / "d", overlength="drop")
    assert dropped["dropped"]["overlength"] == over and dropped["n_samples"] == 10 - over
    few = write_store(tiny, tmp_path / "f", min_loss=100)
    assert few["dropped"]["too_few_loss_tokens"] > 0
    assert few["n_samples"] + few["dropped"]["too_few_loss_tokens"] == 10
    assert min(TokenStore(tmp_path / "f").n_loss_tokens) >= 100


def test_store_round_trip_and_pickling(tiny, tmp_path):
    manifest = write_store(tiny, tmp_path / "s", max_seq_len=1000)
    store = TokenStore(tmp_path / "s")
    expected = encode_conversations(tiny, [r["messages"] for r in rows(10)])
    assert len(store) == 10 == manifest["n_samples"]
    assert store.manifest == manifest and store.lengths.dtype == np.int32
    assert store.conversation_ids == [f"c{i}" for i in range(10)]
    for sample_id in (7, 0, 9):
        ids, mask = store[sample_id]
        assert np.array_equal(ids, expected[sample_id][0])
        assert np.array_equal(mask, expected[sample_id][1])
        assert store.lengths[sample_id] == len(ids)
    clone = pickle.loads(pickle.dumps(store))
    assert np.array_equal(clone[9][0], store[9][0])
    with pytest.raises(IndexError):
        store[10]


def test_same_input_gives_byte_identical_store(tiny, tmp_path):
    write_store(tiny, tmp_path / "a", chunk=3)
    write_store(tiny, tmp_path / "b", chunk=4)
    for name in ("tokens.bin", "loss_mask.bin", "index.parquet", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_stages_end_to_end(tmp_path, monkeypatch):
    """ingest -> tokenizer -> tokenize through the stage functions, twice, same bytes."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "data/raw/chats.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows(12)))
    config = stage_config(source, chunk_size=5)
    outputs = []
    for _ in range(2):
        ingest_stage.run(config, WS)
        tokenizer_stage.run(config, WS)
        WS.regenerated.mkdir(parents=True, exist_ok=True)
        WS.regenerated_conversations.write_bytes(WS.conversations.read_bytes())
        tokenize_stage.run(config, WS)
        outputs.append({p.name: p.read_bytes() for p in sorted(WS.tokenized.iterdir())})
    assert outputs[0] == outputs[1]
    store = TokenStore(WS.tokenized)
    info = json.loads((WS.tokenizer / INFO_FILE).read_text())
    assert store.manifest["tokenizer_hash"] == info["hash"]
    assert store.manifest["mask_token_id"] == info["mask_token_id"]
    assert len(store) > 0 and store.lengths.max() <= 48


def test_store_is_byte_identical_for_any_worker_count(tiny, tmp_path):
    """Two forked workers with chunks in flight write exactly what one process writes."""
    one = write_store(tiny, tmp_path / "one", chunk=2, workers=1)
    two = write_store(tiny, tmp_path / "two", chunk=2, workers=2)
    assert one == two and one["n_samples"] == 10
    for name in ("tokens.bin", "loss_mask.bin", "index.parquet", "manifest.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


CALL = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {"role": "tool", "content": "3 degrees"},
    {"role": "assistant", "content": "It is 3 degrees."},
]


def test_tool_calls_are_learned_and_tool_results_are_not(tiny):
    ids, mask = encode_conversation(tiny, TOOL_CHAT)
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    end = tokenizer.IM_END
    assert masked_text(tiny, ids, mask) == f"Checking.{call}{end}It is 3 degrees.{end}"
    assert tiny.decode(ids.tolist()) == tiny.apply_chat_template(TOOL_CHAT, tokenize=False)


def test_tool_calls_are_learned_under_a_foreign_template(tiny):
    """A template with its own tool-call markup, as Hugging Face templates render them."""
    tiny.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% if m['tool_calls'] %}[CALLS]{% for c in m['tool_calls'] %}"
        "{{ c['function']['name'] }}({{ c['function']['arguments'] }}){% endfor %}{% endif %}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    try:
        ids, mask = encode_conversation(tiny, TOOL_CHAT)
    finally:
        tiny.chat_template = tokenizer.CHAT_TEMPLATE
    end = tokenizer.IM_END
    expected = f'Checking.[CALLS]weather({{"city": "Oslo"}}){end}It is 3 degrees.{end}'
    assert masked_text(tiny, ids, mask) == expected


def stage_config(source, vocab_size=300, **data) -> Config:
    data = {"eval_fraction": 0.1, "max_seq_len": 48, **data}
    return Config(
        data=DataConfig(source=str(source), **data),
        tokenizer=TokenizerConfig(vocab_size=vocab_size),
        drafter=DrafterConfig(block_size=2),
        # Params are checked across sections when built: answers must fit max_seq_len.
        regenerate=RegenerateConfig(max_new_tokens=16),
        evaluate=EvaluateConfig(max_new_tokens=16),
    )


def test_interrupted_stages_leave_their_old_outputs(tmp_path, monkeypatch):
    """A tokenizer or tokenize run that dies before its last write changes nothing."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "data/raw/chats.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows(12)))
    config = stage_config(source)
    ingest_stage.run(config, WS)
    tokenizer_stage.run(config, WS)
    WS.regenerated.mkdir(parents=True, exist_ok=True)
    WS.regenerated_conversations.write_bytes(WS.conversations.read_bytes())
    tokenize_stage.run(config, WS)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer_stage, "write_json_atomic", die)
    monkeypatch.setattr(tokenize_stage, "write_json_atomic", die)
    with pytest.raises(KeyboardInterrupt):
        tokenizer_stage.run(stage_config(source, vocab_size=320), WS)
    with pytest.raises(KeyboardInterrupt):
        tokenize_stage.run(stage_config(source, max_seq_len=64), WS)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_zero_samples_fails_with_the_report_and_writes_nothing(tmp_path, monkeypatch, caplog):
    """Every answer shorter than 2 x block_size loss tokens: exit 1, the error logged with the
    report says why (the record itself: ``run_stage`` sets up the terminal handler)."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "data/raw/chats.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows(3)))
    ingest_stage.run(stage_config(source, eval_fraction=0.0), WS)
    tokenizer_stage.run(stage_config(source), WS)
    WS.regenerated.mkdir(parents=True, exist_ok=True)
    WS.regenerated_conversations.write_bytes(WS.conversations.read_bytes())
    config = Config(
        data=DataConfig(source=str(source), max_seq_len=512, regenerate=False),
        tokenizer=TokenizerConfig(vocab_size=300),
        drafter=DrafterConfig(block_size=200),
    )
    assert tokenize_stage.run(config, WS) == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    report = json.loads(error[error.index("{") :])
    assert report["n_samples"] == 0 and report["dropped"]["too_few_loss_tokens"] == 3
    assert report["assistant_turns"]["learned"] == 6
    assert not WS.tokenized.exists()


def test_turns_policy_and_template_options_reach_the_store(tiny, tmp_path):
    """per_turn: one sample per assistant turn; the report counts turns learned and left out."""
    writer = TokenStoreWriter(tmp_path / "s")
    policy = tokenize.Policy(1000, "truncate", 1, "per_turn", {"unused_option": True})
    counts = tokenize.tokenize_chunks(batches(rows(4), 3), tiny, writer, policy)
    manifest = writer.close(counts)
    assert manifest["n_samples"] == 8 and manifest["turns"] == "per_turn"
    assert manifest["assistant_turns"]["learned"] == 8
    assert sum(manifest["assistant_turns"].values()) == 8
