"""Log lines name their stage, and a training rank's lines its rank; the command line sets
this up for every stage, with ``DFLASH_LOG_LEVEL`` saying how much is shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from dflash import cli, logs
from dflash.logs import StageFormatter

PARAMS = str(Path(__file__).parents[1] / "params.yaml")


def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("dflash.train.loop", level, __file__, 1, message, None, None)


def test_a_training_ranks_line_carries_its_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert StageFormatter("train").format(record("resumed at epoch 1")) == (
        "[train rank 3] resumed at epoch 1"
    )


def test_a_single_process_stage_names_itself_and_says_what_a_warning_is(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    formatter = StageFormatter("ingest")
    assert formatter.format(record("read 3")) == "[ingest] read 3"
    assert formatter.format(record("one skipped", logging.WARNING)) == (
        "[ingest] warning: one skipped"
    )


def test_the_rank_comes_from_an_initialised_process_group(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert logs.rank() == 0
    finally:
        dist.destroy_process_group()
    assert logs.rank() is None


@pytest.fixture
def fresh_logger(monkeypatch):
    """The ``dflash`` logger as a new process has it, and as it was again afterwards."""
    monkeypatch.delenv("RANK", raising=False)
    logger = logging.getLogger("dflash")
    handlers, level = logger.handlers[:], logger.level
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def stage_that_logs(config, workspace) -> int:
    log = logging.getLogger("dflash.data.ingest")
    log.debug("chunk 1")
    log.info("read 3")
    log.warning("one skipped")
    return 0


@pytest.mark.parametrize(
    "level, out",
    [
        (None, "[ingest] read 3\n"),
        ("debug", "[ingest] debug: chunk 1\n[ingest] read 3\n"),
        ("WARNING", ""),
    ],
)
def test_the_command_line_prints_a_stages_log_lines(fresh_logger, monkeypatch, capsys, level, out):
    if level is not None:
        monkeypatch.setenv(logs.LEVEL_VAR, level)
    monkeypatch.setattr(cli, "resolve", lambda stage: stage_that_logs)
    assert cli.main(["ingest", "--params", PARAMS]) == 0
    assert capsys.readouterr() == (out, "[ingest] warning: one skipped\n")


def test_an_unknown_level_is_an_exit_2_error(fresh_logger, monkeypatch, capsys):
    monkeypatch.setenv(logs.LEVEL_VAR, "loud")
    monkeypatch.setattr(cli, "resolve", lambda stage: stage_that_logs)
    assert cli.main(["ingest", "--params", PARAMS]) == 2
    err = capsys.readouterr().err
    assert "dflash ingest: DFLASH_LOG_LEVEL = 'LOUD': not a level" in err
    assert "Traceback" not in err
