"""``dflash.heap``: collection paused while a block imports, what it made frozen (its garbage
freed first), and the teardown's collection skipped."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from dflash.heap import imports_settled


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """The name of a module no test imported yet."""
    (tmp_path / "settled_probe.py").write_text("TABLE = {'made': 'at import'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "settled_probe"
    sys.modules.pop("settled_probe", None)
    gc.unfreeze()  # the worker's later collections see everything again


def test_a_block_that_imports_frees_its_garbage_and_freezes_the_rest(fresh_module):
    frozen = gc.get_freeze_count()
    with imports_settled():
        assert not gc.isenabled()
        garbage = Cycle()
        dead = weakref.ref(garbage)
        del garbage
        module = __import__(fresh_module)
    assert gc.isenabled()
    assert dead() is None
    assert gc.get_freeze_count() > frozen
    assert not any(o is module.TABLE for o in gc.get_objects())  # frozen: out of every generation


def test_a_block_that_imports_nothing_new_only_pauses():
    frozen = gc.get_freeze_count()
    with imports_settled():
        assert not gc.isenabled()
        import json  # noqa: F401  (imported long before)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_collection_disabled_before_stays_disabled(fresh_module):
    gc.disable()
    try:
        with imports_settled():
            __import__(fresh_module)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("skipped", [False, True])
def test_the_teardown_collects_nothing_once_skipped(skipped):
    """A cycle left at exit is finalized by the teardown's collection, unless it is skipped."""
    script = (
        "import gc\n"
        "from dflash.heap import skip_exit_collection\n"
        "class Cycle:\n"
        "    def __init__(self): self.me = self\n"
        "    def __del__(self): print('collected', flush=True)\n"
        "gc.disable()\n"
        "Cycle()\n" + ("skip_exit_collection(); skip_exit_collection()\n" if skipped else "")
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert ("collected" in out.stdout) is not skipped
