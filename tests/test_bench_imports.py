"""Every benchmark still imports: a bench is run by hand, so a moved name would go unseen."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_module_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as when run: the script's folder comes first
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)
    spec.loader.exec_module(module)  # top level only: every bench runs under __main__
