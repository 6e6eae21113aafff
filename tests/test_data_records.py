"""Ingest keeps what chat templates read: tools, reasoning, call ids, and hands them on."""

import json

import pytest

from dflash.data.conversations import read_conversations, write_conversations
from dflash.data.records import RecordError, parse_record

WEATHER = {"name": "weather", "description": "Current weather", "parameters": {"type": "object"}}
OPENAI_TOOL = {"type": "function", "function": WEATHER}


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_is_kept_under_one_name(key):
    record = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", key: "Add them.", "content": "4"},
        ]
    }
    assistant = parse_record(record)["messages"][1]
    assert assistant == {"role": "assistant", "content": "4", "reasoning_content": "Add them."}


def test_a_reasoning_only_answer_is_not_empty():
    record = {
        "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "reasoning": "r"}]
    }
    assert parse_record(record)["messages"][1]["reasoning_content"] == "r"


def test_openai_tools_call_ids_and_tool_names_are_kept():
    record = {
        "tools": [OPENAI_TOOL],
        "messages": [
            {"role": "user", "content": "Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "function": {"name": "weather", "arguments": {}}}],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "3"},
            {"role": "assistant", "content": "3 degrees."},
        ],
    }
    conversation = parse_record(record)
    assert conversation["tools"] == [OPENAI_TOOL]
    assert conversation["messages"][1]["tool_calls"][0]["id"] == "c1"
    assert conversation["messages"][2] == {
        "role": "tool",
        "content": "3",
        "tool_call_id": "c1",
        "name": "weather",
    }


SHAREGPT = [{"from": "human", "value": "Oslo?"}, {"from": "gpt", "value": "Cold."}]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": json.dumps([WEATHER])},
        {"tools": [OPENAI_TOOL]},
        {"system": json.dumps([WEATHER])},
    ],
)
def test_sharegpt_tool_lists_become_openai_schemas(extra):
    conversation = parse_record({"conversations": SHAREGPT, **extra})
    assert conversation["tools"] == [OPENAI_TOOL]
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]


def test_sharegpt_system_prompt_becomes_a_system_message():
    conversation = parse_record({"conversations": SHAREGPT, "system": "Be brief.", "tools": ""})
    assert conversation["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "tools" not in conversation


def test_bad_tool_schemas_are_wrong_shape():
    for tools in ("{}", [{"description": "no name"}], 3):
        with pytest.raises(RecordError) as err:
            parse_record({"tools": tools, "messages": [{"role": "assistant", "content": "a"}]})
        assert err.value.reason == "wrong_shape"


def test_tools_change_the_content_hash():
    plain = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with_tools = {**plain, "tools": [OPENAI_TOOL]}
    assert parse_record(plain)["conversation_id"] != parse_record(with_tools)["conversation_id"]


def test_everything_round_trips_through_the_parquet_format(tmp_path):
    rows = [
        parse_record(
            {
                "tools": [OPENAI_TOOL],
                "messages": [
                    {"role": "user", "content": "Oslo?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "reasoning_content": "Call it.",
                        "tool_calls": [{"id": "c1", "function": {"name": "weather"}}],
                    },
                    {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "3"},
                    {"role": "assistant", "content": "<think>\nok\n</think>\n\n3 degrees."},
                ],
            }
        ),
        parse_record({"conversations": SHAREGPT}),
    ]
    write_conversations(rows, tmp_path / "c.parquet")
    assert read_conversations(tmp_path / "c.parquet") == rows
