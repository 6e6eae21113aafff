"""Hostile sources: records the parser cannot take are counted, files that lie are refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflash import cli
from dflash.data import ingest
from dflash.data.conversations import read_conversations
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

GOOD = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ],
    }
    for i in range(8)
]


def workspace(tmp_path, monkeypatch, name: str) -> str:
    """A workspace whose params point ``data.source`` at ``data/raw/<name>``."""
    (tmp_path / "data/raw").mkdir(parents=True)
    (tmp_path / "params.yaml").write_text(f"data: {{source: data/raw/{name}, eval_fraction: 0}}\n")
    monkeypatch.chdir(tmp_path)
    return f"data/raw/{name}"


def lines(*records) -> bytes:
    return b"".join(
        (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records
    )


def report() -> dict:
    return json.loads(WS.ingest_report.read_text())


def test_deep_nesting_among_good_records_is_counted_and_the_good_kept(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "deep.jsonl")
    deep = b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    (tmp_path / source).write_bytes(lines(*GOOD[:4], deep, *GOOD[4:]))
    assert cli.main(["ingest"]) == 0
    assert report()["skipped"]["too_deep"] == {"count": 1, "first_lines": [5]}
    assert len(read_conversations(WS.conversations)) == len(GOOD)


def test_overlong_lines_are_counted_and_skipped_unread(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "long.jsonl")
    monkeypatch.setattr(ingest, "MAX_LINE_BYTES", 200)
    monkeypatch.setattr(ingest, "SKIP_CHUNK", 7)
    huge = {"messages": [{"role": "user", "content": "x" * 5000}, GOOD[0]["messages"][1]]}
    bad_bytes = b"\xff" * 300
    (tmp_path / source).write_bytes(lines(GOOD[0], huge, GOOD[1], bad_bytes, GOOD[2]))
    assert cli.main(["ingest"]) == 0
    skipped = report()["skipped"]
    assert skipped["too_long"] == {"count": 2, "first_lines": [2, 4]}
    assert report()["records_read"] == 5 and report()["kept"]["train"] == 3


def test_invalid_utf8_is_counted_not_fatal(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "latin.jsonl")
    latin = '{"messages": [{"role": "user", "content": "café"}]}'.encode("latin-1")
    (tmp_path / source).write_bytes(lines(GOOD[0], latin, GOOD[1]))
    assert cli.main(["ingest"]) == 0
    assert report()["skipped"]["invalid_utf8"] == {"count": 1, "first_lines": [2]}


@pytest.mark.parametrize("content", [b"not parquet at all\n", b"PAR1" + b"\0" * 64 + b"PAR1"])
def test_a_parquet_source_that_is_not_parquet_is_a_clear_error(
    tmp_path, monkeypatch, capsys, content
):
    source = workspace(tmp_path, monkeypatch, "fake.parquet")
    (tmp_path / source).write_bytes(content)
    assert cli.main(["ingest"]) == 2
    err = capsys.readouterr().err
    assert source in err and "not a readable Parquet file" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not WS.ingested.exists()


def test_a_link_out_of_data_raw_is_refused_like_a_path_outside(tmp_path, monkeypatch, capsys):
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_bytes(lines(*GOOD))
    source = workspace(tmp_path, monkeypatch, "link.jsonl")
    (tmp_path / source).symlink_to(outside)
    assert cli.main(["ingest"]) == 2
    err = capsys.readouterr().err
    assert "must lie under data/raw/" in err and "dvc import-url" in err and "dvc add" in err
    assert str(outside) in err and "Traceback" not in err
    assert not WS.ingested.exists()
    assert cli.main(["ingest", "--set", "data.source=/tmp/x.jsonl"]) == 2
    assert "must lie under data/raw/" in capsys.readouterr().err


def test_links_inside_data_raw_and_into_the_dvc_cache_are_read(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "link.jsonl")
    cached = tmp_path / ".dvc/cache/files/md5/ab/cdef"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(lines(*GOOD))
    (tmp_path / source).symlink_to(cached)
    assert cli.main(["ingest"]) == 0
    (tmp_path / "data/raw/inner.jsonl").symlink_to(tmp_path / source)
    assert cli.main(["ingest", "--set", "data.source=data/raw/inner.jsonl"]) == 0


LONE_SURROGATES = [
    b'{"messages": [{"role": "user", "content": "q\\ud800"}, '
    b'{"role": "assistant", "content": "a"}]}',
    b'{"id": "\\udfff", "messages": [{"role": "user", "content": "q"}, '
    b'{"role": "assistant", "content": "a"}]}',
    b'{"messages": "[{\\"role\\": \\"user\\", \\"content\\": \\"\\\\ud83d\\"}]"}',
]
PAIR = {"messages": [{"role": "user", "content": "\ud83d\ude00"}, GOOD[0]["messages"][1]]}


def test_lone_surrogates_are_invalid_utf8_and_dropped(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "surrogates.jsonl")
    (tmp_path / source).write_bytes(lines(GOOD[0], *LONE_SURROGATES, PAIR, GOOD[1]))
    assert cli.main(["ingest"]) == 0
    assert report()["skipped"]["invalid_utf8"] == {"count": 3, "first_lines": [2, 3, 4]}
    kept = read_conversations(WS.conversations)
    assert [c["messages"][0]["content"] for c in kept] == ["q0", "\U0001f600", "q1"]


def test_a_prompt_set_counts_lone_surrogates_as_invalid_utf8(tmp_path, monkeypatch):
    from dflash.eval.prompts import read_prompt_file

    (tmp_path / "data/prompts").mkdir(parents=True)
    (tmp_path / "data/prompts/set.jsonl").write_bytes(lines(GOOD[0], *LONE_SURROGATES))
    monkeypatch.chdir(tmp_path)
    conversations, records = read_prompt_file(
        "data/prompts/set.jsonl", "evaluate.sets.s.path", (Path("data/prompts"), Path(".dvc/cache"))
    )
    assert len(conversations) == 1
    assert records["records_read"] == 4 and records["skipped"] == {"invalid_utf8": 3}


def test_blank_lines_are_skipped_not_counted(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "blank.jsonl")
    (tmp_path / source).write_bytes(lines(GOOD[0], b"", b"  \t\r", b"{oops", GOOD[1]) + b"\n")
    assert cli.main(["ingest"]) == 0
    assert report()["records_read"] == 3 and report()["skipped_total"] == 1
    assert report()["skipped"]["invalid_json"] == {"count": 1, "first_lines": [4]}


def test_a_directory_or_fifo_source_says_what_it_is(tmp_path, monkeypatch, capsys):
    workspace(tmp_path, monkeypatch, "x")
    (tmp_path / "data/raw/dir.jsonl").mkdir()
    os.mkfifo(tmp_path / "data/raw/pipe.jsonl")
    (tmp_path / "data/raw/dangling.jsonl").symlink_to(tmp_path / "data/raw/gone.jsonl")
    for name, words in [
        ("dir.jsonl", "is a directory, not a file"),
        ("pipe.jsonl", "is not a regular file (a FIFO, socket or device)"),
        ("dangling.jsonl", "gone.jsonl, which does not exist"),
        ("gone.jsonl", "does not exist"),
    ]:
        assert cli.main(["ingest", "--set", f"data.source=data/raw/{name}"]) == 2
        err = capsys.readouterr().err
        assert f"data.source = 'data/raw/{name}': " in err and words in err
        assert "Traceback" not in err
    assert not WS.ingested.exists()


def test_turns_given_as_text_are_wrong_shape_not_invalid_json(tmp_path, monkeypatch):
    source = workspace(tmp_path, monkeypatch, "text_turns.jsonl")
    (tmp_path / source).write_bytes(lines(GOOD[0], {"messages": "hi"}, GOOD[1]))
    assert cli.main(["ingest"]) == 0
    assert report()["skipped"]["wrong_shape"] == {"count": 1, "first_lines": [2]}
    assert report()["skipped"]["invalid_json"]["count"] == 0


@pytest.mark.parametrize("name", ["loop.jsonl", "loopdir/x.jsonl"])
def test_a_symlink_loop_is_named_a_loop(tmp_path, monkeypatch, capsys, name):
    workspace(tmp_path, monkeypatch, name)
    raw = tmp_path / "data/raw"
    (raw / "loop.jsonl").symlink_to(raw / "back.jsonl")
    (raw / "back.jsonl").symlink_to(raw / "loop.jsonl")
    (raw / "loopdir").symlink_to(raw / "loopdir")
    assert cli.main(["ingest"]) == 2
    err = capsys.readouterr().err
    assert f"data/raw/{name}" in err and "loop of symbolic links" in err
    assert "does not exist" not in err and "Traceback" not in err and err.count("\n") == 1
    assert not WS.ingested.exists()
