"""The library packages import downward only: no workspace, no declaration, no data <-> model.

The stages (``dflash/stages/``) read the workspace and ``dvc.yaml`` and hand the library the
paths and figures it needs, so the library runs from any directory, installed.
"""

from __future__ import annotations

import pytest
from declaration import ROOT

from dflash.pipeline.closure import direct_imports

LIBRARY = ("data", "model", "batching", "train", "eval")
TOP_LEVEL_ONLY = {
    "dflash.paths",
    "dflash.pipeline.workspace",
    "dflash.pipeline.declaration",
    "dflash.pipeline.closure",
}
"""What only the stages and the top-level tools may import."""


def imports_of(package: str) -> dict[str, set[str]]:
    return {
        str(p.relative_to(ROOT)): direct_imports(p)
        for p in sorted((ROOT / "dflash" / package).rglob("*.py"))
    }


@pytest.mark.parametrize("package", LIBRARY)
def test_the_library_reads_no_workspace_and_no_declaration(package):
    found = {m: sorted(i & TOP_LEVEL_ONLY) for m, i in imports_of(package).items()}
    assert not {m: i for m, i in found.items() if i}


@pytest.mark.parametrize("package", LIBRARY)
def test_the_library_imports_no_stage(package):
    found = {m: sorted(i for i in imports if i.startswith("dflash.stages")) for m, imports in
             imports_of(package).items()}  # fmt: skip
    assert not {m: i for m, i in found.items() if i}


@pytest.mark.parametrize(("package", "other"), [("data", "model"), ("model", "data")])
def test_data_and_model_do_not_import_each_other(package, other):
    found = {
        m: sorted(i for i in imports if i.startswith(f"dflash.{other}"))
        for m, imports in imports_of(package).items()
    }
    assert not {m: i for m, i in found.items() if i}


def test_every_stage_runs_from_the_stages_package():
    from dflash.pipeline.declaration import pipeline

    entries = {name: body["meta"]["entry"] for name, body in pipeline().items()}
    assert entries == {name: f"dflash.stages.{name}:run" for name in entries}
