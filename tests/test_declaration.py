"""dvc.yaml declares exactly what each stage reads: its project modules and its params."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from declaration import ROOT, closure, code_deps, covers, dvc_stages, stage_script

from dflash.cli import STAGES, run_stage
from dflash.config import Config, UndeclaredParamError, load_config

PIPELINE = [name for name in STAGES if name != "report"]


def test_every_stage_is_declared_once_in_both_places():
    assert sorted(dvc_stages()) == sorted(PIPELINE)


@pytest.mark.parametrize("name", PIPELINE)
def test_deps_cover_the_import_closure(name):
    stage = dvc_stages()[name]
    deps = code_deps(stage)
    modules = closure(stage_script(stage), name)
    missing = sorted(str(m) for m in modules if not any(covers(d, m) for d in deps))
    assert not missing, f"stage {name}: dvc.yaml misses {missing}"
    unused = sorted(d for d in deps if not any(covers(d, m) for m in modules))
    assert not unused, f"stage {name}: dvc.yaml lists {unused}, which the stage never imports"


@pytest.mark.parametrize("name", PIPELINE)
def test_params_are_the_declared_ones(name):
    declared = STAGES[name]
    in_dvc = dvc_stages()[name].get("params", [])
    assert sorted(in_dvc) == sorted(declared.params)
    assert not set(declared.knobs) & set(in_dvc), "a knob would rerun the stage"
    for key in declared.params + declared.knobs:
        node = Config()
        for part in key.split("."):
            assert dataclasses.is_dataclass(node) and hasattr(node, part), f"{name}: no {key}"
            node = getattr(node, part)


def test_train_declares_only_what_changes_its_outputs():
    params = STAGES["train"].params
    for knob in ("train.checkpoint_every", "train.num_workers", "train.prefetch", "logging"):
        assert not any(
            p == knob or p.startswith(knob + ".") for p in params if p != "logging.every"
        )
    assert "train" not in params and "logging" not in params


def test_a_read_of_an_undeclared_param_is_an_error(monkeypatch):
    seen = {}

    def fake_ingest(config):
        seen["source"] = config.data.source
        return config.train.lr

    monkeypatch.setattr("dflash.cli.resolve", lambda stage: fake_ingest)
    with pytest.raises(UndeclaredParamError, match="train.lr"):
        run_stage("ingest", load_config(None))
    assert seen["source"] == "chitchat"


def test_a_whole_section_allows_its_keys_and_to_dict_shows_only_declared():
    from dflash.config import restrict

    view = restrict(load_config(None), ("tokenizer", "data.max_seq_len"), "x")
    assert view.tokenizer.vocab_size == 4096 and view.data.max_seq_len == 1024
    assert view.to_dict() == {
        "tokenizer": {"path": None, "vocab_size": 4096},
        "data": {"max_seq_len": 1024},
    }
    with pytest.raises(UndeclaredParamError):
        _ = view.data.source


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


def test_file_names_live_in_paths():
    """Outputs are named once, in dflash/paths.py; other modules use its constants."""
    import re

    directories = r"[\"'](data|models|metrics|plots|checkpoints)/"
    file_names = r"[\"'][\w*{}:.-]+\.(json|jsonl|parquet|bin|safetensors|pt|csv|png)[\"']"
    pattern = re.compile(f"{directories}|{file_names}")
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "dflash").rglob("*.py")
        if p.name != "paths.py" and pattern.search(p.read_text())
    ]
    assert not offenders, offenders


def test_declaration_helper_sees_lazy_imports():
    modules = closure(stage_script(dvc_stages()["train"]), "train")
    assert Path("dflash/train/loop.py") in modules  # imported inside launch.run


def test_every_from_pretrained_stays_local():
    """A mistyped path must fail, not reach for a model hub."""
    import re

    calls = re.compile(
        r"(AutoModel\w*|AutoTokenizer|AutoConfig)\.from_pretrained\(([^()]|\([^()]*\))*\)"
    )
    for path in [*ROOT.glob("dflash/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py")]:
        for match in calls.finditer(path.read_text()):
            assert "local_files_only=True" in match.group(0), f"{path}: {match.group(0)}"
