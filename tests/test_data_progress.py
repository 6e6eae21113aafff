"""Progress bars: one plain line per update in a log, a redrawing bar on a terminal."""

import io
import sys

from dflash import progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_output_is_plain_lines_without_carriage_returns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    for _ in progress.progress_bar(range(1000), desc="work"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert 1 <= len(lines) <= 3 and "1000/1000" in lines[-1]
    assert all("\r" not in line for line in lines)


def test_terminal_gets_a_normal_bar(monkeypatch):
    monkeypatch.setattr(sys, "stdout", FakeTerminal())
    bar = progress.progress_bar(total=3)
    assert bar.mininterval < progress.LOG_INTERVAL_S
    bar.close()


def test_a_postfix_every_step_does_not_print_a_line_every_step(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    bar = progress.progress_bar(total=200, desc="train")
    for step in range(200):
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert 1 <= len(lines) <= 3 and "200/200" in lines[-1] and "loss=" in lines[-1]
