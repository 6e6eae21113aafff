"""Faults of the machine while publishing, and output links: one clear line, old output kept."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from dflash import cli, fileio
from dflash.errors import OutputError
from dflash.fileio import atomic_dir, write_json_atomic

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def failing(code: int, real):
    """A stand-in for an os function that fails with ``code`` on a path under construction."""

    def call(src, dst, *args, **kwargs):
        if str(src).endswith(".tmp"):
            raise OSError(code, os.strerror(code), str(src))
        return real(src, dst, *args, **kwargs)

    return call


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_file_write_fault_is_an_output_error_and_keeps_the_old_file(tmp_path, monkeypatch, code):
    path = tmp_path / "out.json"
    write_json_atomic(path, {"v": "old"})
    monkeypatch.setattr(fileio.os, "replace", failing(code, os.replace))
    with pytest.raises(OutputError) as err:
        write_json_atomic(path, {"v": "new"})
    assert str(path) in str(err.value) and errno.errorcode[code] in str(err.value)
    assert err.value.errno == code
    assert json.loads(path.read_text()) == {"v": "old"}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_directory_swap_fault_puts_the_old_directory_back(tmp_path, monkeypatch, code):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    monkeypatch.setattr(Path, "rename", failing(code, Path.rename))
    with pytest.raises(OutputError, match=errno.errorcode[code]), atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_other_os_errors_are_not_dressed_up(tmp_path):
    with pytest.raises(FileNotFoundError), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "missing" / "f").write_text("x")


def ingest_workspace(directory: Path, monkeypatch) -> None:
    (directory / "data/raw").mkdir(parents=True)
    rows = [
        {
            **CHAT,
            "id": str(i),
            "messages": [*CHAT["messages"][:1], {"role": "assistant", "content": f"answer {i}"}],
        }
        for i in range(20)
    ]
    (directory / "data/raw/c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "params.yaml").write_text("data: {source: data/raw/c.jsonl}\n")
    monkeypatch.chdir(directory)


INGEST = ["ingest"]


def test_disk_full_during_a_stage_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    ingest_workspace(tmp_path, monkeypatch)
    assert cli.main(INGEST) == 0
    before = (tmp_path / "data/ingested/conversations.parquet").read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(fileio.os, "replace", failing(errno.ENOSPC, os.replace))
    assert cli.main(INGEST) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ENOSPC" in err and "data/ingested" in err
    assert "Traceback" not in err
    assert (tmp_path / "data/ingested/conversations.parquet").read_bytes() == before


def test_an_output_directory_that_is_a_link_is_followed_every_time(tmp_path, monkeypatch, capsys):
    ingest_workspace(tmp_path, monkeypatch)
    elsewhere = tmp_path / "elsewhere" / "ingested"
    elsewhere.mkdir(parents=True)
    (tmp_path / "data/ingested").symlink_to(elsewhere)
    for _ in range(2):
        assert cli.main(INGEST) == 0, capsys.readouterr().err
    link = tmp_path / "data/ingested"
    assert link.is_symlink() and link.resolve() == elsewhere
    assert (elsewhere / "conversations.parquet").is_file()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["ingested", "raw"]
    assert sorted(p.name for p in elsewhere.parent.iterdir()) == ["ingested"]
