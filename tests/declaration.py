"""What each stage really reads, computed from the code: its import closure and its params.

Shared by ``tests/test_declaration.py`` (compared with ``dvc.yaml``) and
``tests/ci_declaration.py`` (which checks what ``dvc status`` invalidates).
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from dflash.cli import STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dflash"


def module_file(name: str) -> Path | None:
    """``dflash.a.b`` -> its file under ROOT, or None when it is not a module of the project."""
    base = ROOT / Path(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def direct_imports(path: Path) -> set[str]:
    """Project modules ``path`` imports anywhere (top level or inside functions)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != PACKAGE:
            continue
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py too.
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in found if module_file(name) is not None}


def closure(script: Path, stage: str) -> set[Path]:
    """Project files the stage runs: its script, what it imports, and its entry module's tree.

    ``dflash.cli`` finds the entry module by name at run time, so it is added by hand. Package
    ``__init__.py`` files holding only a docstring run no code and are left out.
    """
    seen: set[Path] = set()
    todo = [script, module_file(STAGES[stage].entry.partition(":")[0])]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [module_file(name) for name in direct_imports(path)]
    return {path.relative_to(ROOT) for path in seen if not _docstring_only(path)}


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
    )


def dvc_stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_script(stage: dict) -> Path:
    """The ``stages/*.py`` file a stage's ``cmd`` runs."""
    scripts = [word for word in stage["cmd"].split() if word.startswith("stages/")]
    assert len(scripts) == 1, stage["cmd"]
    return ROOT / scripts[0]


def code_deps(stage: dict) -> set[str]:
    """The deps of a stage that are code (under ``stages/`` or the package)."""
    return {d for d in stage.get("deps", []) if d.startswith(("stages/", f"{PACKAGE}/", PACKAGE))}


def covers(dep: str, path: Path) -> bool:
    return str(path) == dep or str(path).startswith(dep.rstrip("/") + "/")


def readers_of(module: str) -> set[str]:
    """The stages whose closure holds ``module`` (a path relative to ROOT)."""
    return {
        name
        for name, stage in dvc_stages().items()
        if Path(module) in closure(stage_script(stage), name)
    }
