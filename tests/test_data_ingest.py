"""Ingest: both record schemas, every class of bad input counted, dedup, split, chitchat."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash import cli
from dflash.config.schema import Config, DataConfig
from dflash.data import conversations, ingest
from dflash.data.chitchat import chat_to_record
from dflash.data.conversations import ConversationWriter, read_conversations, write_conversations
from dflash.data.records import BOM, RecordError, parse_record
from dflash.fileio import SIGINT_EXIT
from dflash.pipeline.workspace import Workspace
from dflash.stages import ingest as ingest_stage

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

PARAMS = Path(__file__).parents[1] / "params.yaml"

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
        ({"messages": 3}, "wrong_shape"),
        ({"messages": "hi"}, "wrong_shape"),  # valid JSON: the turns are text, not turns
        ({"messages": "{}"}, "wrong_shape"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, "wrong_shape"),
        ({"messages": [{"role": "user", "content": "a"}, "b"]}, "wrong_shape"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": " "}]}, "empty_content"),
        ({"messages": [{"role": "bot", "content": "a"}]}, "unknown_role"),
        ({"messages": [{"role": ["user"], "content": "a"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "wrong_shape"),
        ({"messages": "[{not json"}, "wrong_shape"),
        ({"conversations": [{"from": "function_call", "value": "{oops"}]}, "wrong_shape"),
        ({"messages": [{"role": "assistant", "content": "a"}], "tools": "[oops"}, "wrong_shape"),
        ({"messages": "[" * 100_000}, "too_deep"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "wrong_shape"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "no_assistant_turn"),
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
        b"",  # 15 blank line: no record, skipped uncounted
        b"{",  # 16 invalid_json
    ]
    source = raw_source(tmp_path, "in.jsonl")
    write_jsonl(source, lines)
    monkeypatch.chdir(tmp_path)
    ingest_stage.run(Config(data=DataConfig(source=str(source), eval_fraction=0.0)), WS)

    report = json.loads((tmp_path / "data/ingested/ingest_report.json").read_text())
    skipped = {reason: entry["first_lines"] for reason, entry in report["skipped"].items()}
    assert skipped == {
        "invalid_utf8": [3],
        "invalid_json": [2, 16],
        "too_deep": [],
        "too_long": [],
        "wrong_shape": [7],
        "empty_content": [4],
        "unknown_role": [5],
        "no_assistant_turn": [6],
    }
    assert report["duplicates_removed"] == {"count": 1, "first_lines": [8]}
    assert report["records_read"] == 15  # 16 lines, one of them blank
    train = read_conversations(tmp_path / "data/ingested/conversations.parquet")
    assert len(train) == 7 == report["kept"]["train"]
    assert report["records_read"] == len(train) + report["skipped_total"] + 1


def test_parquet_source_with_both_schemas(tmp_path, monkeypatch):
    rows = [
        {"messages": OPENAI["messages"], "conversations": None},
        {"messages": None, "conversations": SHAREGPT["conversations"]},
        {"messages": None, "conversations": None},
    ]
    source = raw_source(tmp_path, "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), source)
    monkeypatch.chdir(tmp_path)
    ingest_stage.run(Config(data=DataConfig(source=str(source), eval_fraction=0.0)), WS)
    report = json.loads((tmp_path / "data/ingested/ingest_report.json").read_text())
    assert report["kept"]["train"] == 2
    assert report["skipped"]["wrong_shape"] == {"count": 1, "first_lines": [3]}


def numbered(conversations):
    return enumerate(({"id": f"c{i}", "messages": m} for i, m in enumerate(conversations)), 1)


def split(tmp_path, records, eval_fraction, max_conversations):
    """``ingest.ingest`` into a fresh directory, read back: ``(train, heldout, report)``."""
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    train, heldout = out / "conversations.parquet", out / "heldout.parquet"
    report = ingest.ingest(records, train, heldout, eval_fraction, max_conversations)
    assert sorted(p.name for p in out.iterdir()) == ["conversations.parquet", "heldout.parquet"]
    train = read_conversations(out / "conversations.parquet")
    return train, read_conversations(out / "heldout.parquet"), report


def test_split_is_deterministic_and_keyed_by_id(tmp_path):
    train, heldout, report = split(tmp_path, numbered(CHATS), 0.2, None)
    assert 20 < len(heldout) < 60 and len(train) + len(heldout) == 200
    shuffled = list(numbered(CHATS))[::-1]
    train2, heldout2, _ = split(tmp_path, shuffled, 0.2, None)
    assert {c["conversation_id"] for c in heldout} == {c["conversation_id"] for c in heldout2}


def test_max_conversations_caps_training_split_only(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "READ_BATCH", 7)  # the cap streams over several batches
    train, heldout, report = split(tmp_path, numbered(CHATS), 0.2, 10)
    full_train, full_heldout, _ = split(tmp_path, numbered(CHATS), 0.2, None)
    assert len(train) == 10 and heldout == full_heldout
    assert report["left_out_by_max_conversations"] == len(full_train) - 10
    assert [c for c in full_train if c in train] == train
    smallest = sorted(full_train, key=lambda c: ingest.split_key(c["conversation_id"]))[:10]
    assert sorted(c["conversation_id"] for c in smallest) == sorted(
        c["conversation_id"] for c in train
    )


def test_same_id_with_other_content_is_kept_under_a_new_id(tmp_path):
    other = {
        **OPENAI,
        "messages": [*OPENAI["messages"][:2], {"role": "assistant", "content": "Hey."}],
    }
    records = [(1, OPENAI), (2, other)]
    train, _, report = split(tmp_path, records, 0.0, None)
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


TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
OPENAI_TOOLS = {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", **TOOL_CALL}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "3 degrees."},
    ]
}
SHAREGPT_TOOLS = {
    "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": '{"temp": 3}'},
        {"from": "gpt", "value": "3 degrees."},
    ]
}
TOOL_MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": '{"temp": 3}'},
    {"role": "assistant", "content": "3 degrees."},
]
OPENAI_TOOL_MESSAGES = [
    TOOL_MESSAGES[0],
    {**TOOL_MESSAGES[1], "tool_calls": [{**TOOL_CALL, "id": "call_1"}]},
    {**TOOL_MESSAGES[2], "tool_call_id": "call_1"},
    TOOL_MESSAGES[3],
]
"""The OpenAI record's shape, with the call id and the id its result answers, which
Mistral-style templates render."""


def test_tool_call_conversations_are_kept_in_one_shape():
    assert parse_record(OPENAI_TOOLS)["messages"] == OPENAI_TOOL_MESSAGES
    assert parse_record(SHAREGPT_TOOLS)["messages"] == TOOL_MESSAGES


def test_text_part_lists_are_flattened():
    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "what is it?"}]
    record = {"messages": [{"role": "user", "content": parts}, OPENAI["messages"][2]]}
    assert parse_record(record)["messages"][0] == {"role": "user", "content": "Look:\nwhat is it?"}


def raw_source(tmp_path, name: str):
    """A source file where the ingest stage takes them from: ``data/raw/`` (a DVC dep)."""
    (tmp_path / "data" / "raw").mkdir(parents=True, exist_ok=True)
    return tmp_path / "data" / "raw" / name


def run_cli(source, *extra) -> int:
    """Run ingest from ``source``'s workspace (two levels above ``data/raw/``)."""
    relative = source.relative_to(source.parents[2])
    params = ["--params", str(PARAMS)]
    return cli.main(["ingest", *params, "--set", f"data.source={relative}", *extra])


def test_bom_jsonl_and_tool_calls_round_trip_through_the_stage(tmp_path, monkeypatch):
    source = raw_source(tmp_path, "in.jsonl")
    source.write_bytes(BOM + b"\n".join(json.dumps(r).encode() for r in (OPENAI, OPENAI_TOOLS)))
    monkeypatch.chdir(tmp_path)
    assert run_cli(source, "--set", "data.eval_fraction=0") == 0
    train = read_conversations(tmp_path / WS.conversations)
    assert [c["messages"] for c in train] == [OPENAI["messages"], OPENAI_TOOL_MESSAGES]


def test_parquet_messages_column_of_json_strings_is_parsed(tmp_path, monkeypatch):
    rows = [{"messages": json.dumps(r["messages"])} for r in (OPENAI, OPENAI_TOOLS)]
    source = raw_source(tmp_path, "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), source)
    monkeypatch.chdir(tmp_path)
    assert run_cli(source, "--set", "data.eval_fraction=0") == 0
    train = read_conversations(tmp_path / WS.conversations)
    assert [c["messages"] for c in train] == [OPENAI["messages"], OPENAI_TOOL_MESSAGES]


def test_no_usable_record_fails_with_the_report_and_writes_nothing(tmp_path, monkeypatch, capsys):
    source = raw_source(tmp_path, "bad.jsonl")
    write_jsonl(source, [b"{oops", json.dumps({"messages": []}).encode()])
    monkeypatch.chdir(tmp_path)
    assert run_cli(source) == 1
    err = capsys.readouterr().err
    assert "no usable training conversations" in err
    report = json.loads(err[err.index("{") :])
    assert report["skipped"]["invalid_json"] == {"count": 1, "first_lines": [1]}
    assert report["skipped"]["wrong_shape"] == {"count": 1, "first_lines": [2]}
    assert not (tmp_path / WS.ingested).exists()


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.parquet"])
def test_missing_source_is_a_clear_error(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    assert run_cli(raw_source(tmp_path, name)) == 2
    err = capsys.readouterr().err
    assert f"data.source = 'data/raw/{name}': does not exist" in err and "Traceback" not in err


def test_a_run_killed_between_writes_leaves_the_old_outputs(tmp_path, monkeypatch):
    source = raw_source(tmp_path, "in.jsonl")
    source.write_text("".join(json.dumps(r) + "\n" for r in numbered_records(40)))
    monkeypatch.chdir(tmp_path)
    assert run_cli(source, "--set", "data.eval_fraction=0.3") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / WS.ingested).iterdir()}
    source.write_text("".join(json.dumps(r) + "\n" for r in numbered_records(80)))
    closed = []

    def close_then_die(self):
        original_close(self)
        closed.append(self)
        if len(closed) == 2:  # the training split is written, the held-out split is not
            raise KeyboardInterrupt

    original_close = ConversationWriter.close
    monkeypatch.setattr(ConversationWriter, "close", close_then_die)
    assert run_cli(source, "--set", "data.eval_fraction=0.3") == SIGINT_EXIT
    after = {p.name: p.read_bytes() for p in (tmp_path / WS.ingested).iterdir()}
    assert after == before
    state = WS.lock.parts[0]  # the workspace's lock and records, never an output
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != state) == ["data"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["ingested", "raw"]


def numbered_records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "messages": chat} for i, chat in enumerate(CHATS[:n])]


def test_report_is_exact_across_many_row_groups(tmp_path, monkeypatch):
    """Streaming in groups of 3 rows counts and splits exactly as one pass in memory would."""
    monkeypatch.setattr(conversations, "ROW_GROUP", 3)
    lines = []
    for i, record in enumerate(numbered_records(60)):
        lines.append(json.dumps(record).encode())
        if i % 7 == 0:
            lines.append(json.dumps({"messages": record["messages"]}).encode())  # duplicate
        if i % 11 == 0:
            lines.append(b"[")
    source = raw_source(tmp_path, "in.jsonl")
    write_jsonl(source, lines)
    monkeypatch.chdir(tmp_path)
    cap = ["--set", "data.max_conversations=30", "--set", "data.eval_fraction=0.3"]
    assert run_cli(source, *cap) == 0
    report = json.loads((tmp_path / WS.ingest_report).read_text())
    duplicates = [n for n, line in enumerate(lines, 1) if line.startswith(b'{"messages"')]
    broken = [n for n, line in enumerate(lines, 1) if line == b"["]
    assert report["duplicates_removed"] == {"count": 9, "first_lines": duplicates[:5]}
    assert report["skipped"]["invalid_json"] == {"count": 6, "first_lines": broken[:5]}
    assert report["records_read"] == len(lines) == 75
    heldout = read_conversations(tmp_path / WS.heldout)
    train = read_conversations(tmp_path / WS.conversations)
    assert report["kept"] == {"train": 30, "heldout": len(heldout)} and len(train) == 30
    assert report["left_out_by_max_conversations"] == 60 - len(heldout) - 30
    assert pq.ParquetFile(tmp_path / WS.heldout).metadata.num_row_groups > 1
