"""``dvc exp show`` stays on one screen: the declared metrics files hold the headline only."""

import json
import typing

import yaml
from declaration import ROOT
from pydantic import BaseModel

from dflash.metrics import headline
from dflash.metrics.headline import write_metrics
from dflash.metrics.schema import (
    EvalHeadline,
    RegenerateHeadline,
    TargetHeadline,
    TrainDetails,
    TrainHeadline,
    leaves,
)
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

MAX_LEAVES = 30
HEADLINES = {
    WS.target_metrics: TargetHeadline,
    WS.regenerate_metrics: RegenerateHeadline,
    WS.train_metrics: TrainHeadline,
    WS.eval_metrics: EvalHeadline,
}


def dvc_leaves(model) -> int:
    """The columns DVC makes of one metrics file: a number or string each, lists skipped."""
    count = 0
    for field in model.model_fields.values():
        kinds = (field.annotation, *typing.get_args(field.annotation))
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if nested:
            count += dvc_leaves(nested[0])
        elif not any(typing.get_origin(k) is list for k in kinds):
            count += 1
    return count


def declared_metrics() -> set[str]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {
        next(iter(entry)) if isinstance(entry, dict) else entry
        for stage in stages.values()
        for entry in stage.get("metrics", [])
    }


def test_only_the_headline_files_are_declared_metrics():
    assert declared_metrics() == {str(p) for p in HEADLINES}


def test_the_declared_metrics_hold_at_most_30_leaves():
    counts = {str(p): dvc_leaves(model) for p, model in HEADLINES.items()}
    assert sum(counts.values()) <= MAX_LEAVES, counts


def test_the_headline_keys_are_their_models_keys():
    assert headline.TRAIN == leaves(TrainHeadline)
    assert set(headline.EVAL) | set(headline.CI_ENDS) == set(leaves(EvalHeadline))
    assert "baselines.ngram.acceptance_length" in headline.EVAL


def test_headline_keeps_the_keys_it_has_nested_and_drops_the_rest():
    data = {"a": 1, "b": {"c": 2, "d": 3}, "e": 4}
    assert headline.headline(data, ("a", "b.c", "x.y", "b.z")) == {"a": 1, "b": {"c": 2}}


TRAIN_DETAILS = {
    "data_wait_fraction": 0.01, "drafter_sha256": "0" * 64, "drafter_wait_fraction": 0.0,
    "epochs": 1, "final_accuracy": 0.5, "final_loss": 2.0, "final_simulated_tau": 1.5,
    "flex_compiles": 0, "grad_norm_cv": None, "loss_length_corr": 0.2, "loss_spikes": 0,
    "padded_tokens_per_s": 6.0, "padding_efficiency": 0.8, "planned_steps": 15,
    "projected_hours": 0.01, "simulated_tau_cost": 0.1, "skipped_steps": 0, "steps": 3,
    "target_idle_fraction": 0.0, "tokens_per_s": 5.0, "train_seconds": 1.0, "world_size": 2,
}  # fmt: skip


def test_write_metrics_writes_the_details_whole_and_the_headline_last(tmp_path):
    details = TrainDetails.model_validate(TRAIN_DETAILS)
    write_metrics(tmp_path / "train.json", tmp_path / "details.json", details, TrainHeadline)
    assert json.loads((tmp_path / "details.json").read_text()) == TRAIN_DETAILS
    shown = json.loads((tmp_path / "train.json").read_text())
    assert shown == {k: TRAIN_DETAILS[k] for k in headline.TRAIN if k in TRAIN_DETAILS}
