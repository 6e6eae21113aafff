"""Params a target cannot serve are exit-2 errors naming the key, before any work: at load, or
in the first stage that knows the target's depth. Never a traceback later."""

from pathlib import Path

import pytest
from transformers import Qwen3Config

from dflash import cli
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

PARAMS = str(Path(__file__).parents[1] / "params.yaml")


def run(stage: str, *sets: str) -> int:
    return cli.main([stage, "--params", PARAMS, *(a for s in sets for a in ("--set", s))])


def save_config(directory: Path, layers: int) -> None:
    Qwen3Config(num_hidden_layers=layers, hidden_size=16, num_attention_heads=2).save_pretrained(
        directory
    )


def assert_params_error(capsys, key: str) -> None:
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("regenerate.max_new_tokens=20", "regenerate.max_new_tokens"),
        ("data.chat_template_kwargs={tools: []}", "data.chat_template_kwargs.tools"),
        ("data.chat_template_kwargs=3", "data.chat_template_kwargs"),
        ("evaluate.chat_template_kwargs={messages: 1}", "evaluate.chat_template_kwargs"),
        ("data.turns=per_message", "data.turns"),
        ("data.special_tokens_in_content=strip", "data.special_tokens_in_content"),
        ("evaluate.sets={g: {path: /tmp/g.jsonl}}", "evaluate.sets.g.path = '/tmp/g.jsonl'"),
        ("evaluate.sets={g: {path: data/prompts/g.txt}}", "evaluate.sets.g.path"),
        ("evaluate.sets={g: {}}", "evaluate.sets.g.path = None: a prompt set needs a path"),
        ("evaluate.sets={heldout: {path: data/prompts/h.jsonl}}", "evaluate.sets.heldout.path"),
        (
            "evaluate.sets={g: {path: data/prompts/g.jsonl, nprompts: 3}}",
            "evaluate.sets.g.nprompts",
        ),
        (
            "evaluate.sets={g: {path: data/prompts/g.jsonl, max_new_tokens: 2000}}",
            "evaluate.sets.g.max_new_tokens = 2000",
        ),
        (
            "evaluate.sets={g: {path: data/prompts/g.jsonl, modes: {think: {tools: 1}}}}",
            "evaluate.sets.g.modes.think.tools",
        ),
        ("evaluate.sets={'a b': {path: data/prompts/g.jsonl}}", "evaluate.sets.a b = 'a b'"),
    ],
)
def test_bad_params_fail_at_load(tmp_path, monkeypatch, capsys, setting, key):
    monkeypatch.chdir(tmp_path)
    assert run("ingest", setting) == 2
    assert_params_error(capsys, key)


def test_answers_too_short_to_learn_are_fine_when_nothing_is_regenerated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from dflash.config.params import load_config

    config = load_config(PARAMS, ["regenerate.max_new_tokens=20", "data.regenerate=false"])
    assert config.regenerate.max_new_tokens == 20


def test_target_stage_rejects_a_layer_selection_the_default_target_cannot_give(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert run("target", "target.num_hidden_layers=5", "drafter.num_target_features=3") == 2
    assert_params_error(capsys, "drafter.num_target_features = 3")
    assert not WS.target.exists()


def test_target_stage_reads_a_path_targets_depth_from_its_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_config(tmp_path / "model", 4)
    assert run("target", f"target.path={tmp_path / 'model'}", "drafter.num_target_features=2") == 2
    assert_params_error(capsys, "a 4-layer target")


def test_train_rejects_a_selection_the_built_target_cannot_give(tmp_path, monkeypatch, capsys):
    """The target stage does not rerun when only the drafter changes: train checks again."""
    monkeypatch.chdir(tmp_path)
    save_config(tmp_path / WS.target, 4)
    assert run("train", "drafter.num_target_features=3", "train.world_size=1") == 2
    assert_params_error(capsys, "drafter.num_target_features = 3")
