"""dvc.yaml declares exactly what each stage reads: its project modules and its params."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
from declaration import ROOT, code_deps, covers, dvc_stages, stage_closure, stage_script

from dflash.cli import resolve, run_stage
from dflash.config.params import load_config
from dflash.config.schema import Config
from dflash.errors import UndeclaredParamError
from dflash.pipeline import closure
from dflash.pipeline.declaration import declared_params, restrict, stages

PIPELINE = sorted(dvc_stages())

IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(dflash[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([^\n#]*))"
    r"|import[ \t]+(dflash[\w.]*))",
    re.M,
)
TYPE_ONLY = re.compile(r"^if TYPE_CHECKING:.*\n(?:(?:[ \t]+.*)?\n)*", re.M)
PLUGINS = re.compile(r'^PLUGIN_PACKAGE = "([\w.]+)"', re.M)
DOCSTRING_ONLY = re.compile(r'\s*(?:("""|\'\'\')(?:.|\n)*?\1)?\s*')


def module_files(name: str) -> list[Path]:
    """The files importing ``name`` runs: each enclosing package's ``__init__.py``, then it."""
    parts, files = name.split("."), []
    for i in range(1, len(parts) + 1):
        base = ROOT.joinpath(*parts[:i])
        files += [f for f in (base / "__init__.py", base.with_suffix(".py")) if f.is_file()]
    return files


@functools.cache
def scanned_imports(path: Path) -> frozenset[Path]:
    """Project files ``path`` imports, read off its text line by line, not by
    dflash.pipeline.closure:
    at any indentation (imports in functions), outside ``if TYPE_CHECKING:``, and every
    module of a package it names in ``PLUGIN_PACKAGE``."""
    text = TYPE_ONLY.sub("", path.read_text())
    names = set()
    for base, grouped, single, plain in IMPORT.findall(text):
        words = re.findall(r"\w+", grouped + single)
        names |= {plain} if plain else {base, *(f"{base}.{w}" for w in words)}
    for package in PLUGINS.findall(text):
        folder = ROOT.joinpath(*package.split("."))
        names |= {f"{package}.{p.stem}" for p in folder.glob("*.py")}
    return frozenset(f for name in names for f in module_files(name))


def scanned_closure(name: str) -> set[Path]:
    """A second, plainer reckoning of stage ``name``'s code than the one that wrote dvc.yaml:
    its script and entry module, and all they import in turn; empty ``__init__.py`` files run
    nothing."""
    todo = [ROOT / stage_script(dvc_stages()[name]), module_files(stages()[name].module)[-1]]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += scanned_imports(path)
    empty = {p for p in seen if p.name == "__init__.py" and DOCSTRING_ONLY.fullmatch(p.read_text())}
    return {p.relative_to(ROOT) for p in seen - empty}


def test_every_stage_has_an_entry_and_a_command():
    assert sorted(stages()) == sorted([*PIPELINE, "report", "clean"])
    for name in stages():
        assert callable(resolve(name)), name


@pytest.mark.parametrize("name", PIPELINE)
def test_deps_cover_the_import_closure(name):
    stage = dvc_stages()[name]
    deps = code_deps(stage)
    modules = scanned_closure(name)
    missing = sorted(str(m) for m in modules if not any(covers(d, m) for d in deps))
    # dvc.yaml is written from dflash.pipeline.closure (tests/declaration.py): a fault there would
    # write it wrong and still agree with it, so the expectation is the plain text scan's.
    assert not missing, f"stage {name}: dvc.yaml misses {missing}"
    unused = sorted(d for d in deps if not any(covers(d, m) for m in modules))
    assert not unused, f"stage {name}: dvc.yaml lists {unused}, which the stage never imports"


@pytest.mark.parametrize("name", PIPELINE)
def test_params_and_knobs_name_real_params_and_never_overlap(name):
    declared = stages()[name]
    assert declared.params == tuple(dvc_stages()[name].get("params", []))
    assert not set(declared.knobs) & set(declared.params), "a knob would rerun the stage"
    for key in declared.params + declared.knobs:
        node = Config()
        for part in key.split("."):
            assert part in type(node).model_fields, f"{name}: no {key}"
            node = getattr(node, part)


@pytest.mark.parametrize("name", PIPELINE)
def test_params_yaml_holds_every_declared_param(name):
    """DVC refuses to run a stage whose declared param is missing from params.yaml."""
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key in stages()[name].params:
        node = params
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{name}: params.yaml has no {key}"
            node = node[part]


def test_train_declares_only_what_changes_its_outputs():
    params = stages()["train"].params
    for knob in ("train.checkpoint_every", "train.num_workers", "train.prefetch", "logging"):
        assert not any(
            p == knob or p.startswith(knob + ".") for p in params if p != "logging.every"
        )
    assert "train" not in params and "logging" not in params


def test_a_read_of_an_undeclared_param_is_an_error(monkeypatch):
    seen = {}

    def fake_ingest(config, workspace):
        seen["source"] = config.data.source
        return config.train.lr

    monkeypatch.setattr("dflash.cli.resolve", lambda stage: fake_ingest)
    with pytest.raises(UndeclaredParamError, match="train.lr"):
        run_stage("ingest", load_config(None))
    assert seen["source"] == "chitchat"


def test_a_whole_section_allows_its_keys_and_declared_params_shows_only_those():
    view = restrict(load_config(None), ("tokenizer", "data.max_seq_len"))
    assert isinstance(view, Config)
    assert view.tokenizer.vocab_size == 4096 and view.data.max_seq_len == 512
    assert declared_params(view) == {
        "tokenizer": {"path": None, "vocab_size": 4096},
        "data": {"max_seq_len": 512},
    }
    with pytest.raises(UndeclaredParamError):
        _ = view.data.source


def _runtime_graph() -> dict[str, set[str]]:
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / "dflash").rglob("*.py")
    }
    return {name: closure.direct_imports(path) - {name} for name, path in modules.items()}


def test_no_import_cycle_in_the_package():
    graph, state, cycles = _runtime_graph(), {}, []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_library_never_imports_the_command_line():
    floors = ("dflash.data", "dflash.model", "dflash.batching", "dflash.train", "dflash.eval")
    upward = {
        name
        for name, imports in _runtime_graph().items()
        if name.startswith(floors) and "dflash.cli" in imports
    }
    assert not upward, upward


def test_a_docstring_edit_outside_a_closure_keeps_checkpoints_valid(tmp_path, monkeypatch):
    """Training checkpoints fingerprint the train stage's closure: report.py is not in it, so
    an edit there resumes; an edit in the training loop does not."""
    from dflash.stages.train import fingerprint as run_fingerprint

    shutil.copytree(ROOT / "dflash", tmp_path / "repo" / "dflash")
    monkeypatch.setattr(closure, "ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    config = load_config(ROOT / "params.yaml")
    before = run_fingerprint(config)

    def edit(module: str) -> None:
        path = tmp_path / "repo" / module
        path.write_text('"""An edited docstring."""\n' + path.read_text())

    edit("dflash/commands/report.py")
    assert run_fingerprint(config) == before
    edit("dflash/train/loop.py")
    assert run_fingerprint(config) != before


def test_no_stage_script_shadows_a_module():
    """``python stages/x.py`` puts ``stages/`` first on sys.path: x must not be a real module."""
    for script in (ROOT / "stages").glob("*.py"):
        name = script.stem
        assert name not in sys.stdlib_module_names, f"{script} shadows the standard library"
        assert importlib.util.find_spec(name) is None, f"{script} shadows an installed {name}"
    assert not (ROOT / "stages" / "__init__.py").exists()


def test_stage_scripts_hold_no_path_hack():
    for script in (ROOT / "stages").glob("*.py"):
        assert "sys.path" not in script.read_text(), script


FILE_NAME_HOMES = {
    "dflash/pipeline/workspace.py",  # every stage output, relative to the workspace
    "dflash/batching/io.py",
    "dflash/batching/stats_files.py",
    "dflash/data/ingest.py",
    "dflash/data/regenerate.py",
    "dflash/data/store.py",
    "dflash/data/tokenizer.py",
    "dflash/model/hf_files.py",
    "dflash/model/target_dir.py",  # the reference to a target that is not copied
    "dflash/metrics/schema.py",  # the JSON Schema files it writes
    "dflash/train/checkpointing/checkpoint.py",
    "dflash/train/checkpointing/best.py",  # the best validation's weights beside the checkpoints
    "dflash/features/feature_files.py",  # the feature files and their manifest
    "dflash/pipeline/provenance.py",  # a record per stage
}
"""The workspace, and the modules that own a format's file names (its files, in any directory)."""


def test_file_names_live_in_their_homes():
    """Outputs are named once: the workspace's in dflash/pipeline/workspace.py, a format's own
    files in
    the module that writes the format; others use their constants."""
    import re

    directories = r"[\"'](data|models|metrics|plots|checkpoints)/"
    file_names = r"[\"'][\w*{}:.-]+\.(json|jsonl|parquet|bin|safetensors|pt|csv|png)[\"']"
    pattern = re.compile(f"{directories}|{file_names}")
    homes: dict[str, list[str]] = {}
    offenders = []
    for p in sorted((ROOT / "dflash").rglob("*.py")):
        name = str(p.relative_to(ROOT))
        found = [m.group(0) for m in pattern.finditer(p.read_text())]
        if found and name not in FILE_NAME_HOMES:
            offenders.append(name)
        if name != "dflash/pipeline/workspace.py":
            for literal in set(found):
                homes.setdefault(literal, []).append(name)
    assert not offenders, offenders
    assert not {k: v for k, v in homes.items() if len(v) > 1}, "a file name with two homes"


def test_declaration_helper_sees_lazy_imports():
    modules = stage_closure("train")
    assert Path("dflash/train/loop.py") in modules  # imported inside the stage's _rank


def test_every_from_pretrained_stays_local():
    """A mistyped path must fail, not reach for a model hub."""
    import re

    calls = re.compile(
        r"(AutoModel\w*|AutoTokenizer|AutoConfig)\.from_pretrained\(([^()]|\([^()]*\))*\)"
    )
    for path in [*ROOT.glob("dflash/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py")]:
        for match in calls.finditer(path.read_text()):
            assert "local_files_only=True" in match.group(0), f"{path}: {match.group(0)}"


def test_help_says_what_every_command_does_and_names_publish(capsys):
    from dflash import cli
    from dflash.commands.parsers import COMPARE_HELP, HELP

    assert sorted(HELP) == sorted(stages())
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "python -m dflash.commands.publish DIR" in text and "report stage" not in text
    assert all(" ".join(HELP[name].split()) in text for name in HELP)
    assert " ".join(COMPARE_HELP.split()) in text
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "export it with its model card" in " ".join(capsys.readouterr().out.split())


def test_bytecode_beside_the_code_is_no_stage_dep():
    """dvc.yaml names whole packages (dflash/train ...) as code deps: the ``__pycache__`` that
    running them writes there must not change those deps, or every run reruns its stages."""
    from dvc.repo import Repo

    code = ROOT / "dflash" / "train"
    ignore = Repo(str(ROOT)).dvcignore
    assert ignore.is_ignored_dir(str(code / "__pycache__"))
    assert ignore.is_ignored_file(str(code / "__pycache__" / "loop.cpython-311.pyc"))
    assert not ignore.is_ignored_file(str(code / "loop.py"))
