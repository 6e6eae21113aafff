"""The one answer to "what code does this output depend on?": a module's import closure.

Read from the source (``ast``), imports inside functions included, so what a stage imports
lazily counts too; imports under ``if TYPE_CHECKING:`` run nothing and are left out, as are
package ``__init__.py`` files holding only a docstring. A module that loads a package's
modules by name says so in ``PLUGIN_PACKAGE``, and they count as its imports. Three uses share
it: the training checkpoint fingerprint, regenerate's shard fingerprint, and the test that
``dvc.yaml``'s deps cover each stage's imports. An edit to a module outside a closure changes
nothing of it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from dflash.config.schema import Config
from dflash.fileio import sha256_file
from dflash.pipeline.declaration import declared_params, restrict, stages
from dflash.pipeline.fingerprint import digest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dflash"


def module_file(name: str) -> Path | None:
    """``dflash.a.b`` -> its file under ROOT, or None when it is not a module of the project."""
    base = ROOT / Path(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def direct_imports(path: Path) -> set[str]:
    """Project modules that running ``path`` imports (at top level or inside functions)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    names |= _plugins(tree)
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] == PACKAGE:
            # Importing a.b.c runs a/__init__.py and a/b/__init__.py too.
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in found if module_file(name) is not None}


def _plugins(tree: ast.Module) -> set[str]:
    """The modules of the package a module names in ``PLUGIN_PACKAGE = "..."``: it imports
    them by name at run time (``dflash.batching.registry``), which ``ast`` cannot see."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["PLUGIN_PACKAGE"]
            and isinstance(node.value, ast.Constant)
        ):
            folder = ROOT / Path(*node.value.value.split("."))
            return {f"{node.value.value}.{p.stem}" for p in folder.glob("*.py")}
    return set()


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def closure(*starts: Path) -> frozenset[Path]:
    """Project files (relative to ROOT) that running ``starts`` can execute."""
    seen: set[Path] = set()
    todo = [ROOT / start for start in starts]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [module_file(name) for name in direct_imports(path)]
    return frozenset(p.relative_to(ROOT) for p in seen if not docstring_only(p))


def module_closure(module: str) -> frozenset[Path]:
    """``closure`` of a module named like ``dflash.stages.train``."""
    path = module_file(module)
    if path is None:
        raise ModuleNotFoundError(f"{module} is no module of the project", name=module)
    return closure(path.relative_to(ROOT))


def code_digest(module: str) -> str:
    """SHA-256 over the files of ``module``'s closure, by path: what its outputs depend on."""
    return digest({str(p): sha256_file(ROOT / p) for p in sorted(module_closure(module))})


def declared_inputs(config: Config, name: str) -> dict[str, Any]:
    """What stage ``name``'s outputs depend on by declaration: the params it declares (its knobs
    change how it runs, not what it writes) and its code closure. Resumable work (training
    checkpoints, regenerate shards) fingerprints these beside its data."""
    declared = stages()[name]
    return {
        "params": declared_params(restrict(config, declared.params)),
        "code": code_digest(declared.module),
    }


def docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body
    )
