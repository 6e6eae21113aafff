"""The regenerate stage: assistant turns become the target's own greedy answers, resumably."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_stages

from dflash.config.schema import Config, DataConfig
from dflash.data.conversations import read_conversations, write_conversations
from dflash.data.regenerate import answer_turns
from dflash.data.tokenizer import IM_END, load_tokenizer
from dflash.model.load import load_target
from dflash.pipeline.workspace import Workspace
from dflash.stages import regenerate as regenerate_stage

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""
REPORT = WS.regenerate_report
SHARDS = WS.regenerated_shards

REGENERATE = [
    "data.regenerate=true",
    "regenerate.max_new_tokens=24",
    "regenerate.shard_size=16",
    "regenerate.batch_size=8",
]


@pytest.fixture(scope="module")
def trained_template(tiny_workspace_template, tmp_path_factory):
    """The shared workspace with a target trained long enough to end its turns."""
    directory = tmp_path_factory.mktemp("regenerate") / "ws"
    shutil.copytree(tiny_workspace_template, directory)
    run_stages(
        directory,
        ["target"],
        ["target.pretrain_epochs=6", "target.pretrain_batch_tokens=192", "target.pretrain_lr=0.01"],
    )
    # These tests run regenerate by hand with other params than the target was made with
    # (tests/test_workspace_safety.py covers that refusal): its records are left out.
    shutil.rmtree(directory / Workspace().provenance)
    return directory


@pytest.fixture
def workspace(trained_template, tmp_path):
    directory = tmp_path / "ws"
    shutil.copytree(trained_template, directory)
    return directory


def report(workspace) -> dict:
    return json.loads((workspace / REPORT).read_text())


def outputs(workspace) -> tuple[list[dict], list[dict]]:
    return (
        read_conversations(workspace / WS.conversations),
        read_conversations(workspace / WS.regenerated_conversations),
    )


def greedy_answer(workspace, messages: list[dict], max_new_tokens: int) -> str:
    """The target's own answer, by plain ``generate`` on one unpadded prompt."""
    tokenizer = load_tokenizer(workspace / WS.tokenizer)
    model = load_target(workspace / WS.target)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_assistant_turns_become_the_targets_greedy_answers(workspace):
    run_stages(workspace, ["regenerate"], REGENERATE)
    before, after = outputs(workspace)
    assert [r["conversation_id"] for r in after] == [r["conversation_id"] for r in before]
    changed = 0
    for old, new in zip(before, after, strict=True):
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in old["messages"]]
        for a, b in zip(old["messages"], new["messages"], strict=True):
            if a["role"] == "assistant":
                changed += a["content"] != b["content"]
                assert IM_END not in b["content"]
            else:
                assert a == b
    assert changed > 0
    first = after[0]["messages"]
    turn = next(j for j, m in enumerate(first) if m["role"] == "assistant")
    assert first[turn]["content"] == greedy_answer(workspace, first[:turn], 24)
    stats = report(workspace)
    turns = sum(m["role"] == "assistant" for r in before for m in r["messages"])
    assert stats["turns_regenerated"] + stats["turns_outside_window"] == turns
    assert stats["turns_regenerated"] > 0 and stats["tokens_per_s"] > 0
    assert stats["unterminated_responses"] < stats["turns_regenerated"]
    assert stats["tokens_generated"] < stats["turns_regenerated"] * 24


def test_turns_past_the_window_are_kept_and_counted(workspace):
    run_stages(workspace, ["regenerate"], [*REGENERATE, "data.max_seq_len=40"])
    before, after = outputs(workspace)
    stats = report(workspace)
    assert stats["turns_outside_window"] > 0
    kept = sum(
        a == b
        for old, new in zip(before, after, strict=True)
        for a, b in zip(old["messages"], new["messages"], strict=True)
        if a["role"] == "assistant"
    )
    assert kept >= stats["turns_outside_window"]


def test_an_interrupted_run_resumes_at_the_missing_shard(workspace):
    run_stages(workspace, ["regenerate"], REGENERATE)
    complete = (workspace / WS.regenerated_conversations).read_bytes()
    shards = sorted((workspace / SHARDS).glob("shard_*.json"))
    assert len(shards) == report(workspace)["shards"] > 1
    shards[-1].unlink()
    (workspace / WS.regenerated_conversations).unlink()
    run_stages(workspace, ["regenerate"], REGENERATE)
    assert report(workspace)["shards_made"] == 1
    assert (workspace / WS.regenerated_conversations).read_bytes() == complete


def test_shards_made_with_other_params_are_not_reused(workspace):
    run_stages(workspace, ["regenerate"], REGENERATE)
    run_stages(workspace, ["regenerate"], [*REGENERATE, "regenerate.max_new_tokens=8"])
    stats = report(workspace)
    assert stats["shards_made"] == stats["shards"]
    assert stats["tokens_generated"] <= stats["turns_regenerated"] * 8
    assert len(list((workspace / SHARDS).glob("shard_*.json"))) == stats["shards"]


def test_regenerate_false_copies_the_training_split(workspace):
    run_stages(workspace, ["regenerate"], ["data.regenerate=false"])
    source = (workspace / WS.conversations).read_bytes()
    assert (workspace / WS.regenerated_conversations).read_bytes() == source
    stats = report(workspace)
    assert stats["skipped"] is True
    assert stats["conversations"] == len(read_conversations(workspace / WS.conversations))


def test_no_room_for_a_prompt_is_a_clear_error(workspace):
    with pytest.raises(
        ValueError, match="regenerate.max_new_tokens = 96: must be below data.max_seq_len"
    ):
        run_stages(workspace, ["regenerate"], [*REGENERATE, "regenerate.max_new_tokens=96"])


def test_sampling_is_seeded_per_shard(workspace):
    sampling = [*REGENERATE, "regenerate.temperature=1.0"]
    run_stages(workspace, ["regenerate"], sampling)
    first = (workspace / WS.regenerated_conversations).read_bytes()
    shutil.rmtree(workspace / SHARDS)
    run_stages(workspace, ["regenerate"], sampling)
    assert report(workspace)["shards_made"] == report(workspace)["shards"]
    assert (workspace / WS.regenerated_conversations).read_bytes() == first
    run_stages(workspace, ["regenerate"], [*sampling, "regenerate.seed=1"])
    assert (workspace / WS.regenerated_conversations).read_bytes() != first


def test_tool_calling_turns_are_kept_as_written():
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "a"},
    ]
    assert answer_turns(messages) == [3]


def test_an_interrupted_pass_through_leaves_old_conversations_and_no_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"conversation_id": "a", "messages": [{"role": "assistant", "content": "x"}]}]
    write_conversations(rows, WS.conversations)
    config = Config(data=DataConfig(regenerate=False))
    regenerate_stage.run(config, WS)
    old = (tmp_path / WS.regenerated_conversations).read_bytes()
    assert json.loads((tmp_path / REPORT).read_text())["conversations"] == 1
    write_conversations(rows * 2, WS.conversations)

    def die(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(regenerate_stage.shutil, "copyfile", die)
    with pytest.raises(KeyboardInterrupt):
        regenerate_stage.run(config, WS)
    assert (tmp_path / WS.regenerated_conversations).read_bytes() == old
    assert not (tmp_path / REPORT).exists()
    assert sorted(p.name for p in (tmp_path / WS.regenerated).iterdir()) == [
        "conversations.parquet"
    ]
