"""The shared progress display: a bar on a terminal, plain lines at intervals elsewhere,
never one long line of carriage returns in a log."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

from multihead import progress
from multihead.progress import ProgressBar, format_duration, progress_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_a_plain_line_per_tenth_and_the_last(monkeypatch):
    log = io.StringIO()
    bar = ProgressBar(20, desc="recovery", stream=log)
    for i in range(20):
        bar.update(note=f"loss {i / 10:.1f}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    assert [line.split(" |")[0] for line in lines] == [f"recovery {n}/20" for n in range(2, 21, 2)]
    assert lines[-1].startswith("recovery 20/20 | loss 1.9 | eta ")


def test_a_slow_loop_gets_a_line_when_the_interval_passed(monkeypatch):
    log = io.StringIO()
    bar = ProgressBar(1000, desc="pass", stream=log)
    bar.update()  # 1/1000: not a tenth yet, no time passed
    assert log.getvalue() == ""
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)
    bar.update()
    assert log.getvalue().startswith("pass 2/1000 | eta ")


def test_the_caller_may_decide_which_units_get_a_line():
    log = io.StringIO()
    bar = ProgressBar(4, 2, desc="step", stream=log)  # resumed at 2
    bar.update(3, "loss 1.0", line=False)
    bar.update(4, "loss 0.5", line=True)
    assert log.getvalue().splitlines() == ["step 4/4 | loss 0.5 | eta 0s"]


def test_a_terminal_gets_a_bar():
    pytest.importorskip("tqdm")
    term = _Terminal()
    bar = ProgressBar(10, desc="recovery", stream=term)
    assert bar.is_bar
    for _ in range(10):
        bar.update(note="loss 0.5")
    bar.close()
    assert "10/10" in term.getvalue() and "loss 0.5" in term.getvalue() and "\r" in term.getvalue()


def test_disabled_writes_nothing():
    log = io.StringIO()
    with progress_bar(5, False, "x") as step:
        step()
    bar = ProgressBar(5, enabled=False, stream=log)
    bar.update()
    bar.message("hello")
    assert log.getvalue() == ""


def test_format_duration():
    assert [format_duration(s) for s in (0, 7.4, 312, 3723)] == ["0s", "7s", "5m12s", "1h02m03s"]


def test_a_piped_command_writes_lines_not_carriage_returns():
    """What a user sees in ``... 2> log``: complete lines, one per interval."""
    code = textwrap.dedent("""
        from multihead.progress import progress_bar
        with progress_bar(500, True, "head importance", "pass") as step:
            for _ in range(500):
                step("x" * 20)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr and len(lines) == 10 and max(map(len, lines)) < 80, done.stderr
    assert lines[-1].startswith("head importance 500/500 | " + "x" * 20)


def test_a_unit_reported_again_gets_no_second_line():
    """A display that polls (compare follows a run's metrics) repeats units; the log does not."""
    log = io.StringIO()
    bar = ProgressBar(4, desc="[1/2] mha seed 0", stream=log)
    for n in (1, 1, 2, 4, 4, 4):
        bar.update(n, "loss 1.0")
    assert [line.split(" |")[0] for line in log.getvalue().splitlines()] == [
        "[1/2] mha seed 0 1/4", "[1/2] mha seed 0 2/4", "[1/2] mha seed 0 4/4"
    ]
