"""What each stage really reads, computed from the code: its import closure and its params.

Shared by ``tests/test_declaration.py`` (compared with ``dvc.yaml``) and
``tests/ci_declaration.py`` (which checks what ``dvc status`` invalidates). The closure is
``dflash.pipeline.closure``'s, the one the fingerprints use.
"""

from __future__ import annotations

from pathlib import Path

from dflash.pipeline.closure import PACKAGE, ROOT, closure, docstring_only, module_file
from dflash.pipeline.declaration import pipeline, stages

__all__ = ["ROOT", "code_deps", "covers", "dvc_stages", "readers_of", "stage_closure"]


def dvc_stages() -> dict[str, dict]:
    return pipeline()


def stage_script(stage: dict) -> Path:
    """The ``stages/*.py`` file a stage's ``cmd`` runs."""
    scripts = [word for word in stage["cmd"].split() if word.startswith("stages/")]
    assert len(scripts) == 1, stage["cmd"]
    return Path(scripts[0])


def stage_closure(name: str) -> frozenset[Path]:
    """Project files the stage runs: its script, what it imports, and its entry module's tree
    (``dflash.cli`` imports the entry by name at run time)."""
    entry = module_file(stages()[name].module).relative_to(ROOT)
    return closure(stage_script(dvc_stages()[name]), entry)


def code_deps(stage: dict) -> set[str]:
    """The deps of a stage that are code (under ``stages/`` or the package)."""
    return {d for d in stage.get("deps", []) if d.startswith(("stages/", f"{PACKAGE}/", PACKAGE))}


def covers(dep: str, path: Path) -> bool:
    return str(path) == dep or str(path).startswith(dep.rstrip("/") + "/")


def readers_of(module: str) -> set[str]:
    """The stages whose closure holds ``module`` (a path relative to ROOT)."""
    return {name for name in dvc_stages() if Path(module) in stage_closure(name)}


def closure_deps(name: str) -> list[str]:
    """The code deps ``dvc.yaml`` should list for a stage: its closure, with a package folder
    named once when the stage runs every module in it."""
    files = {str(p) for p in stage_closure(name)}
    deps = set(files)
    for folder in sorted({str(Path(f).parent) for f in files if f.startswith(PACKAGE + "/")}):
        members = {
            str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py") if not docstring_only(p)
        }
        inside_named = any(covers(d, Path(folder)) for d in deps if d != folder)
        if folder != PACKAGE and members <= files and not inside_named:
            deps = {d for d in deps if not covers(folder, Path(d))} | {folder}
    scripts = sorted(d for d in deps if d.startswith("stages/"))
    return scripts + sorted(deps - set(scripts))


def write_deps() -> None:
    """Rewrite the code deps of every stage in ``dvc.yaml`` (``python tests/declaration.py``)."""
    from dflash.pipeline.declaration import DVC_YAML

    lines = DVC_YAML.read_text().splitlines(keepends=True)
    out, stage, in_deps = [], None, False
    for line in lines:
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith(":"):
            stage = line.strip().rstrip(":")
        if line.strip() == "deps:":
            in_deps = True
            out.append(line)
            out += [f"      - {d}\n" for d in closure_deps(stage)]
            continue
        if in_deps and line.startswith("      - "):
            dep = line.strip()[2:]
            if not dep.startswith(("stages/", PACKAGE)):
                out.append(line)
            continue
        in_deps = False
        out.append(line)
    DVC_YAML.write_text("".join(out))


if __name__ == "__main__":
    write_deps()
