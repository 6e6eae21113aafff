"""Ingest: both record schemas, every class of bad input counted, dedup, split, chitchat."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.config import Config, DataConfig
from dflash.data import ingest
from dflash.data.chitchat import chat_to_record
from dflash.data.conversations import read_conversations, write_conversations
from dflash.data.records import RecordError, parse_record

OPENAI = {
    "id": "a1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "What is 2+2?"},
        {"from": "gpt", "value": "4"},
    ]
}

CHATS = [
    [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    for i in range(200)
]


def test_openai_record_keeps_its_id():
    conversation = parse_record(OPENAI)
    assert conversation["conversation_id"] == "a1"
    assert conversation["messages"] == OPENAI["messages"]


def test_sharegpt_record_maps_roles_and_hashes_an_id():
    conversation = parse_record(SHAREGPT)
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert conversation["messages"][1]["content"] == "4"
    assert conversation["conversation_id"] == parse_record(dict(SHAREGPT))["conversation_id"]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "wrong_shape"),
        ({"text": "hi"}, "wrong_shape"),
        ({"messages": "hi"}, "wrong_shape"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, "wrong_shape"),
        ({"messages": [{"role": "user", "content": "a"}, "b"]}, "wrong_shape"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": " "}]}, "empty_content"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "unknown_role"),
        ({"conversations": [{"from": "user", "value": "a"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "a"}]}, "no_assistant_turn"),
    ],
)
def test_bad_records_name_their_reason(record, reason):
    with pytest.raises(RecordError) as err:
        parse_record(record)
    assert err.value.reason == reason


def write_jsonl(path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_jsonl_ingest_counts_every_skip_reason_with_line_numbers(tmp_path, monkeypatch):
    good = [json.dumps({"messages": chat}).encode() for chat in CHATS[:6]]
    lines = [
        good[0],  # 1
        b"{not json",  # 2 invalid_json
        b'{"messages": "\xff\xfe"}',  # 3 invalid_utf8
        json.dumps({"messages": [{"role": "user", "content": ""}]}).encode(),  # 4 empty
        json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(),  # 5 unknown
        json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),  # 6 no asst
        json.dumps([1]).encode(),  # 7 wrong_shape
        good[0],  # 8 duplicate
        json.dumps(SHAREGPT).encode(),  # 9
        *good[1:],  # 10..14
        b"",  # 15 blank line: invalid JSON, counted, not ignored
    ]
    source = tmp_path / "in.jsonl"
    write_jsonl(source, lines)
    monkeypatch.chdir(tmp_path)
    ingest.run(Config(data=DataConfig(source=str(source), eval_fraction=0.0)))

    report = json.loads((tmp_path / "data/ingested/ingest_report.json").read_text())
    skipped = {reason: entry["first_lines"] for reason, entry in report["skipped"].items()}
    assert skipped == {
        "invalid_utf8": [3],
        "invalid_json": [2, 15],
        "wrong_shape": [7],
        "empty_content": [4],
        "unknown_role": [5],
        "no_assistant_turn": [6],
    }
    assert report["duplicates_removed"] == {"count": 1, "first_lines": [8]}
    assert report["records_read"] == 15
    train = read_conversations(tmp_path / "data/ingested/conversations.parquet")
    assert len(train) == 7 == report["kept"]["train"]
    assert report["records_read"] == len(train) + report["skipped_total"] + 1


def test_parquet_source_with_both_schemas(tmp_path, monkeypatch):
    rows = [
        {"messages": OPENAI["messages"], "conversations": None},
        {"messages": None, "conversations": SHAREGPT["conversations"]},
        {"messages": None, "conversations": None},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    monkeypatch.chdir(tmp_path)
    ingest.run(Config(data=DataConfig(source=str(tmp_path / "in.parquet"), eval_fraction=0.0)))
    report = json.loads((tmp_path / "data/ingested/ingest_report.json").read_text())
    assert report["kept"]["train"] == 2
    assert report["skipped"]["wrong_shape"] == {"count": 1, "first_lines": [3]}


def numbered(conversations):
    return enumerate(({"id": f"c{i}", "messages": m} for i, m in enumerate(conversations)), 1)


def test_split_is_deterministic_and_keyed_by_id():
    train, heldout, report = ingest.ingest(numbered(CHATS), 0.2, None)
    assert 20 < len(heldout) < 60 and len(train) + len(heldout) == 200
    shuffled = list(numbered(CHATS))[::-1]
    train2, heldout2, _ = ingest.ingest(shuffled, 0.2, None)
    assert {c["conversation_id"] for c in heldout} == {c["conversation_id"] for c in heldout2}


def test_max_conversations_caps_training_split_only():
    train, heldout, report = ingest.ingest(numbered(CHATS), 0.2, 10)
    full_train, full_heldout, _ = ingest.ingest(numbered(CHATS), 0.2, None)
    assert len(train) == 10 and heldout == full_heldout
    assert report["left_out_by_max_conversations"] == len(full_train) - 10
    assert all(c in full_train for c in train)


def test_same_id_with_other_content_is_kept_under_a_new_id():
    other = {
        **OPENAI,
        "messages": [*OPENAI["messages"][:2], {"role": "assistant", "content": "Hey."}],
    }
    records = [(1, OPENAI), (2, other)]
    train, _, report = ingest.ingest(records, 0.0, None)
    assert len(train) == 2 and report["duplicate_ids_renamed"]["count"] == 1
    assert train[0]["conversation_id"] == "a1" != train[1]["conversation_id"]


def test_chitchat_merges_a_speakers_messages_and_alternates_roles():
    chat = {
        "messages": [
            [{"text": "Hello", "sender": "A"}, {"text": "How are you?", "sender": "A"}],
            [{"text": "good", "sender": "B"}],
            [{"text": "  ", "sender": "A"}],
            [{"text": "and you?", "sender": "B"}],
            [{"text": "fine", "sender": "A"}],
        ]
    }
    record, blank = chat_to_record("x", chat)
    assert blank == 1
    assert record["messages"] == [
        {"role": "user", "content": "Hello\nHow are you?"},
        {"role": "assistant", "content": "good\nand you?"},
        {"role": "user", "content": "fine"},
    ]
    assert parse_record(record)["conversation_id"] == "x"


def test_conversations_round_trip(tmp_path):
    rows = [parse_record(OPENAI), parse_record(SHAREGPT)]
    write_conversations(rows, tmp_path / "c.parquet")
    assert read_conversations(tmp_path / "c.parquet") == rows
    assert not list(tmp_path.glob("*.tmp"))
