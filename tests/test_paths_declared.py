"""``dvc.yaml`` and :class:`dflash.pipeline.workspace.Workspace` name the same paths: a path added,
renamed or dropped in one fails here until the other follows."""

from pathlib import Path

import yaml
from declaration import ROOT

from dflash.batching import stats_files
from dflash.batching.io import PLAN_SUMMARY
from dflash.data.store import STORE_INDEX
from dflash.pipeline.workspace import Workspace

WS = Workspace()

UNDECLARED = {
    WS.dvc_cache: "DVC's own cache",
    WS.provenance: "the workspace's own state",
    WS.lock: "the workspace's own state",
    WS.train_failures: "the workspace's own state: a failed job's report",
    WS.checkpoints: "resume state: never an output (dvc.yaml's header)",
    WS.regenerated_shards: "resume state: never an output (dvc.yaml's header)",
    WS.hidden_states: "the engines' drop box: each file is read once, then deleted",
}
"""The workspace's paths that ``dvc.yaml`` must not name, and why."""

FORMAT_NAMES = {
    STORE_INDEX,
    PLAN_SUMMARY,
    stats_files.LENGTHS,
    stats_files.BUCKETS,
    stats_files.HISTOGRAM,
    stats_files.PLOT,
    "metrics.json",  # DVCLive's summary and curves directory, inside its directory
    "plots",
}
"""File names inside a workspace directory that are a format's own
(``dflash.pipeline.workspace``)."""


def workspace_paths() -> set[Path]:
    names = [n for n, v in vars(Workspace).items() if isinstance(v, property)]
    return {getattr(WS, n) for n in names}


def declared_paths() -> set[Path]:
    """Every data path ``dvc.yaml`` names: stage deps other than code, outs, metrics, plots,
    and the files its top-level plots read."""
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    paths = set()
    for stage in spec["stages"].values():
        for key in ("deps", "outs", "metrics", "plots"):
            for entry in stage.get(key, []):
                paths.add(next(iter(entry)) if isinstance(entry, dict) else entry)
    for plot in spec.get("plots", []):
        for body in plot.values():
            paths.update(body["y"])
    return {Path(p) for p in paths if not p.startswith(("dflash/", "stages/"))}


def test_every_path_dvc_names_is_a_workspace_path():
    named, known = declared_paths(), workspace_paths()
    stray = {
        p for p in named if p not in known and not (p.parent in known and p.name in FORMAT_NAMES)
    }
    assert not stray, (
        f"dvc.yaml names paths dflash.pipeline.workspace.Workspace lacks: {sorted(stray)}"
    )


def test_every_workspace_path_is_in_dvc_yaml_unless_it_says_why_not():
    named = declared_paths()

    def covered(path: Path) -> bool:
        return any(p == path or p in path.parents or path in p.parents for p in named)

    assert not {p for p in UNDECLARED if covered(p)}, "declared, yet listed as undeclared"
    missing = {p for p in workspace_paths() - set(UNDECLARED) if not covered(p)}
    assert not missing, f"Workspace paths dvc.yaml never names: {sorted(missing)}"
