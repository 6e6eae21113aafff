"""``dvc exp show`` stays on one screen: the declared metrics files hold the headline only."""

import json

import yaml
from declaration import ROOT

from dflash import headline
from dflash.eval.outputs import eval_headline
from dflash.headline import write_metrics
from dflash.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

MAX_LEAVES = 30
HEADLINES = {
    WS.target_metrics: headline.TARGET,
    WS.regenerate_metrics: headline.REGENERATE,
    WS.train_metrics: headline.TRAIN,
    WS.eval_metrics: headline.EVAL,
}


def dvc_leaves(tree) -> int:
    """The columns DVC makes of one metrics file: a number or string each, lists skipped."""
    if isinstance(tree, dict):
        return sum(dvc_leaves(v) for v in tree.values())
    return int(isinstance(tree, int | float | str))


def declared_metrics() -> set[str]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {
        next(iter(entry)) if isinstance(entry, dict) else entry
        for stage in stages.values()
        for entry in stage.get("metrics", [])
    }


def full(keys: tuple[str, ...]) -> dict:
    """A details dict holding every headline key (a list where the contract has one), and more."""
    data: dict = {"detail": 1, "nested": {"detail": 2}}
    for key in keys:
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {"detail": 3})
        node[leaf] = (
            [1.0, 2.0] if leaf in ("acceptance_length_ci95", "per_position_acceptance") else 1.0
        )
    return data


def test_only_the_headline_files_are_declared_metrics():
    assert declared_metrics() == {str(p) for p in HEADLINES}


def test_the_declared_metrics_hold_at_most_30_leaves():
    shown = {p: headline.headline(full(keys), keys) for p, keys in HEADLINES.items()}
    shown[WS.eval_metrics] = eval_headline(full(headline.EVAL))
    counts = {str(p): dvc_leaves(tree) for p, tree in shown.items()}
    assert sum(counts.values()) <= MAX_LEAVES, counts


def test_headline_keeps_the_keys_it_has_nested_and_drops_the_rest():
    data = {"a": 1, "b": {"c": 2, "d": 3}, "e": 4}
    assert headline.headline(data, ("a", "b.c", "x.y", "b.z")) == {"a": 1, "b": {"c": 2}}


def test_write_metrics_writes_the_details_whole_and_the_headline_last(tmp_path):
    data = {"tokens_per_s": 5.0, "world_size": 2, "drafter_sha256": "0" * 64}
    write_metrics(tmp_path / "train.json", tmp_path / "details.json", data, headline.TRAIN)
    assert json.loads((tmp_path / "details.json").read_text()) == data
    assert json.loads((tmp_path / "train.json").read_text()) == {"tokens_per_s": 5.0}
