"""Durable writes: a failed write leaves the old file, a finished one leaves no temporary."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

from dflash.fileio import (
    atomic_dir,
    atomic_path,
    recover_dir,
    reset_dir,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)


def test_writes_create_parents_and_leave_no_temporary(tmp_path):
    path = tmp_path / "a" / "b" / "out.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == json.dumps({"b": 1, "a": [1, 2]}, indent=2) + "\n"
    write_json_atomic(path, {"b": 1, "a": 2}, sort_keys=True)
    assert path.read_text().index('"a"') < path.read_text().index('"b"')
    write_text_atomic(path, "x", fsync=True)
    assert path.read_text() == "x"
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_sha256_file_and_reset_dir(tmp_path):
    data = bytes(range(256)) * 5000
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(data)
    assert sha256_file(tmp_path / "d" / "f") == hashlib.sha256(data).hexdigest()
    reset_dir(tmp_path / "d")
    reset_dir(tmp_path / "new" / "dir")
    assert list((tmp_path / "d").iterdir()) == [] and (tmp_path / "new" / "dir").is_dir()


def test_atomic_dir_replaces_whole_or_keeps_old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("killed between writes")
    assert sorted(p.name for p in out.iterdir()) == ["stale.txt"]
    assert not (tmp_path / "out.tmp").exists()
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
        (tmp / "b.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, mask):
    old = os.umask(mask)
    try:
        with atomic_path(tmp_path / "one.bin") as tmp:
            tmp.write_bytes(b"w")
            tmp.chmod(0o600)  # as safetensors creates its files
        with atomic_dir(tmp_path / "dir") as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "weights").write_bytes(b"w")
            (tmp / "sub" / "weights").chmod(0o600)
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "run.sh").chmod(0o700)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert modes == {
        "one.bin": 0o666 & ~mask,
        "dir": 0o777 & ~mask,
        "dir/sub": 0o777 & ~mask,
        "dir/sub/weights": 0o666 & ~mask,
        "dir/run.sh": 0o777 & ~mask,
    }


KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from dflash.fileio import atomic_dir

rename = os.rename


def rename_then_die(*args, **kwargs):
    rename(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


os.rename = rename_then_die
with atomic_dir(sys.argv[1]) as tmp:
    (tmp / "a.txt").write_text("new")
"""
"""Replaces ``sys.argv[1]`` whole and is SIGKILLed right after the first rename: the old
directory moved to ``.old``, the new one not yet in its place."""


def test_a_kill_between_the_renames_of_a_swap_loses_neither_output(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    child = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(out)])
    assert child.returncode == -signal.SIGKILL
    assert not out.exists() and (tmp_path / "out.old" / "a.txt").read_text() == "old"

    # The next write puts the old output back first: a failure leaves it whole.
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        raise RuntimeError("killed again, while filling")
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    child = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(out)])
    assert child.returncode == -signal.SIGKILL and recover_dir(out)
    assert (out / "a.txt").read_text() == "old" and not recover_dir(out)
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
