"""The τ scorecard: prompt sets, strata with intervals, and z-lab's count of τ."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import WORDS, run_stages, tiny_qwen3
from test_metrics_schema import DATA_FILES, RUN_FILES, assert_files_round_trip

from dflash.commands.publish import main as publish_main
from dflash.commands.report import render_report
from dflash.data.tokenizer import load_tokenizer
from dflash.eval.metrics import summarize_method
from dflash.eval.prompts import Prompt, read_prompt_file, render_prompts
from dflash.eval.records import prompt_records, read_records, records_csv
from dflash.eval.strata import groups, strata
from dflash.model.generate import GenerateOutput, greedy_generate, speculative_generate

BS = 4


class Oracle:
    """Proposes the target's own greedy continuation: every draft is accepted."""

    uses_features = False

    def __init__(self, reference: list[int], prompt_length: int) -> None:
        self.reference, self.prompt_length = reference, prompt_length

    def start(self, hidden_states, length: int) -> None:
        pass

    def propose(self, history: list[int], position: int) -> list[int]:
        done = len(history) - self.prompt_length
        return self.reference[done : done + BS - 1]

    def commit(self, hidden_states, position: int, count: int) -> None:
        pass


def test_zlab_count_takes_the_whole_last_block_past_a_stop_or_the_budget():
    target = tiny_qwen3(hidden_size=48, intermediate_size=96)
    prompt = [40, 41, 42, 43, 44, 45]
    reference = greedy_generate(target, prompt, 64)
    # A stop token, first seen where it cuts a block of accepted drafts short.
    k = next(k for k in range(2, 40) if reference.index(reference[k]) == k and k % BS != 0)
    out = speculative_generate(
        target, Oracle(reference, len(prompt)), prompt, 64, BS, [reference[k]]
    )
    assert out.tokens == reference[: k + 1]
    assert out.agreed == [BS] * len(out.agreed)
    assert out.accepted[-1] < BS and sum(out.accepted) == k
    budget = 1 + BS + 2  # the prefill's token, one whole block, then 2 the budget leaves
    cut = speculative_generate(target, Oracle(reference, len(prompt)), prompt, budget, BS)
    assert cut.tokens == reference[:budget]
    assert cut.accepted == [BS, 2] and cut.agreed == [BS, BS] and cut.full == [True, False]


def output(accepted: list[int], agreed: list[int] | None = None) -> GenerateOutput:
    tokens = [0] * (1 + sum(accepted))
    return GenerateOutput(tokens, accepted, [True] * len(accepted), agreed or accepted, 0.0, 1.0)


def test_zlab_tau_is_the_same_mean_over_responses_of_the_agreed_count():
    spec = [output([4, 2], [4, 4]), output([1, 3], [1, 3])]
    metrics = summarize_method(spec, [output([1] * 6), output([1] * 4)], seed=0)
    assert metrics["acceptance_length"] == pytest.approx((3 + 2) / 2)
    assert metrics["acceptance_length_zlab"] == pytest.approx((4 + 2) / 2)


def test_strata_split_by_mode_tools_and_length_with_their_own_intervals():
    prompts = [
        Prompt(list(range(n)), mode, tools)
        for n, mode, tools in [(5, "a", False), (5, "b", False), (9, "a", True), (9, "b", True),
                               (20, "a", False), (20, "b", False)]
    ]  # fmt: skip
    by = groups(prompts, ["a", "b"])
    assert by["mode"] == {"a": [0, 2, 4], "b": [1, 3, 5]}
    assert by["tools"] == {"with": [2, 3], "without": [0, 1, 4, 5]}
    assert by["length"] == {"short": [0, 1], "medium": [2, 3], "long": [4, 5]}
    assert "mode" not in groups(prompts, ["a"])
    dflash = [output([a]) for a in (1, 2, 3, 4, 4, 4)]
    ngram = [output([1]) for _ in prompts]
    table = strata(prompts, ["a", "b"], {"dflash": dflash, "ngram": ngram}, BS, seed=0)
    assert table["tools"]["with"]["acceptance_length"] == pytest.approx(3.5)
    assert table["tools"]["with"]["n_prompts"] == 2
    assert table["length"]["long"]["prompt_tokens"] == [20, 20]
    assert table["mode"]["b"]["ngram_acceptance_length"] == 1.0
    lo, hi = table["mode"]["a"]["acceptance_length_ci95"]
    assert 1.0 <= lo <= table["mode"]["a"]["acceptance_length"] <= hi <= 4.0
    empty = strata(prompts[:2], ["a", "b"], {"dflash": dflash[:2], "ngram": ngram[:2]}, BS, 0)
    assert empty["tools"]["with"] == {
        "n_prompts": 0,
        "acceptance_length": None,
        "acceptance_length_ci95": None,
        "acceptance_length_zlab": None,
        "ngram_acceptance_length": None,
        "per_position_acceptance": None,
    }


def write_prompt_set(workspace, name: str) -> None:
    (workspace / "data/prompts").mkdir(parents=True, exist_ok=True)
    (workspace / "data/prompts" / name).write_text("\n".join(prompt_set_lines()) + "\n")


def prompt_set_lines() -> list[str]:
    records = [
        {"messages": [{"role": "user", "content": f"tell me about the {w} {w}"}]} for w in WORDS[:5]
    ]
    records.append(
        {
            "messages": [
                {"role": "user", "content": "look up the cat"},
                {"role": "assistant", "content": "the cat sat"},
                {"role": "user", "content": "and the dog"},
            ],
            "tools": [{"type": "function", "function": {"name": "look", "parameters": {}}}],
        }
    )
    lines = [json.dumps(r) for r in records]
    return [*lines, "{not json", json.dumps({"messages": []}), lines[0]]


def test_per_prompt_records_round_trip_with_their_strata_and_tau():
    prompts = [Prompt([1, 2, 3], "a", False), Prompt([4, 5, 6, 7, 8], "b", True)]
    methods = {"dflash": [output([2, 4]), GenerateOutput(tokens=[1])], "ngram": [output([1])] * 2}
    records = read_records(records_csv(prompt_records("qs", prompts, ["a", "b"], methods)))
    assert [r["tau"] for r in records] == [3.0, None] and records[1]["tokens"] == 1
    assert records[1]["strata"] == ["mode:b", "tools:with", "length:long"]
    assert records[0]["digest"] != records[1]["digest"] and records[0]["set"] == "qs"


def test_a_prompt_file_counts_what_it_cannot_use_and_scores_questions_at_their_end(
    tmp_path, monkeypatch, tiny_workspace
):
    monkeypatch.chdir(tiny_workspace)
    write_prompt_set(tiny_workspace, "set.jsonl")
    conversations, records = read_prompt_file(
        "data/prompts/set.jsonl", "evaluate.sets.s.path", (Path("data/prompts"), Path(".dvc/cache"))
    )
    assert len(conversations) == 6
    assert records == {
        "records_read": 9,
        "skipped": {"invalid_json": 1, "wrong_shape": 1},
        "duplicates_removed": 1,
    }
    tokenizer = load_tokenizer(tiny_workspace / "models/tokenizer")
    modes = {"plain": {}, "other": {"unused_option": True}}
    skipped: dict = {}
    prompts = render_prompts(conversations, tokenizer, modes, 40, 10, 0, True, skipped)
    assert len(prompts) == 12 and not skipped
    assert [p.mode for p in prompts[:2]] == ["plain", "other"]
    assert sum(p.tools for p in prompts) == 2
    tool_prompt = next(p for p in prompts if p.tools)
    assert tokenizer.decode(tool_prompt.ids).endswith(
        "and the dog<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(render_prompts(conversations, tokenizer, modes, 40, 3, 0, True, skipped)) == 6


def test_evaluate_scores_every_set_with_strata(tiny_workspace):
    write_prompt_set(tiny_workspace, "questions.jsonl")
    sets = (
        "evaluate.sets={questions: {path: data/prompts/questions.jsonl, max_new_tokens: 8, "
        "num_prompts: 6, modes: {plain: {}, other: {unused_option: true}}}, "
        "heldout: {num_prompts: 3}}"
    )
    run_stages(
        tiny_workspace,
        ["plan", "train", "evaluate"],
        ["train.world_size=1", "train.epochs=1", sets],
    )
    assert_files_round_trip(tiny_workspace, {**DATA_FILES, **RUN_FILES})
    metrics = json.loads((tiny_workspace / "metrics/eval_details.json").read_text())
    assert metrics["n_prompts"] == 3 and metrics["modes"] == ["default"]
    assert set(metrics["strata"]) == {"tools", "length"}
    questions = metrics["sets"]["questions"]
    assert set(questions) == set(metrics) - {"sets", "drafter_sha256"}
    assert questions["n_prompts"] == 12 and questions["lossless_mismatches"] == 0
    assert questions["records"]["skipped"] == {"invalid_json": 1, "wrong_shape": 1}
    assert questions["strata"]["mode"]["plain"]["n_prompts"] == 6
    assert questions["strata"]["tools"]["with"]["n_prompts"] == 2
    assert questions["acceptance_length_zlab"] >= questions["acceptance_length"]
    rows = list(csv.DictReader(open(tiny_workspace / "plots/eval/strata.csv")))
    assert rows[0]["label"] == "heldout all"
    assert "questions mode:other" in [r["label"] for r in rows]
    records = read_records((tiny_workspace / "metrics/eval_prompts.csv").read_text())
    asked = [r for r in records if r["set"] == "questions"]
    assert len(records) == 15 and [r["prompt"] for r in asked] == list(range(12))
    taus = [r["tau"] for r in asked if r["tau"] is not None]
    assert sum(taus) / len(taus) == pytest.approx(questions["acceptance_length"])
    assert sum("tools:with" in r["strata"] for r in asked) == 2
    report = render_report(tiny_workspace)
    assert "scorecard" in report and "questions   mode:plain" in report
    live = json.loads((tiny_workspace / "dvclive/evaluate/metrics.json").read_text())
    assert live["questions_acceptance_length"] == questions["acceptance_length"]
    publish_with_its_scorecard(tiny_workspace)


def publish_with_its_scorecard(workspace):
    """The export copied with the scorecard of the evaluation that scored these weights."""
    out = workspace / "published"
    assert publish_main([str(out), "--root", str(workspace)]) == 0
    card = (out / "README.md").read_text()
    assert "## Scorecard" in card and "| questions | mode:plain |" in card
    assert "dflash.commands.publish" not in card  # the note pointing here is replaced by the table
    assert (out / "model.safetensors").read_bytes() == (
        workspace / "models/drafter/model.safetensors"
    ).read_bytes()
    metrics = workspace / "metrics/eval_details.json"
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "drafter_sha256": "0"}))
    assert publish_main([str(workspace / "other"), "--root", str(workspace)]) == 2
    assert not (workspace / "other").exists()
