"""flows/terminal.py: summary lines stay, stage detail is a status line rewritten in place on a terminal,
lines under --verbose, nothing in a log file."""

from __future__ import annotations

import io
import time

from rlstage.flows import terminal
from rlstage.flows.terminal import CLEAR, Terminal


def test_a_log_gets_summary_lines_only(monkeypatch):
    monkeypatch.delenv("RLSTAGE_VERBOSE", raising=False)
    out = io.StringIO()  # not a TTY
    t = Terminal(out)
    t.status("  [iter   1/3] rollout   ...")
    t.line("iteration   1: held-out accuracy 0.500")
    t.status(None)
    assert out.getvalue() == "iteration   1: held-out accuracy 0.500\n"


def test_verbose_prints_stage_detail_as_lines(monkeypatch):
    monkeypatch.setenv("RLSTAGE_VERBOSE", "1")
    out = io.StringIO()
    t = Terminal(out, live=True)
    t.status("  [iter   1/3] rollout   ...")
    t.line("iteration   1: done")
    assert out.getvalue() == "  [iter   1/3] rollout   ...\niteration   1: done\n"


def test_a_terminal_shows_the_running_stage_with_its_time_and_reported_progress(monkeypatch):
    monkeypatch.delenv("RLSTAGE_VERBOSE", raising=False)
    monkeypatch.setattr(terminal, "TICK_S", 0.05)
    out = io.StringIO()
    t = Terminal(out, live=True)
    notes = iter(["step 10/600, loss 1.234", None, None])
    t.status("  [kit] SFT", read_note=lambda: next(notes, None))
    deadline = time.monotonic() + 5
    while "step 10/600" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    t.line("  [kit] SFT checkpoint abc: held-out accuracy 0.312")
    t.status(None)
    text = out.getvalue()
    # The status line is redrawn in place (never a newline), keeps the last reported note, and is erased
    # before a line that stays.
    assert f"{CLEAR}  [kit] SFT 0s · step 10/600, loss 1.234" in text
    assert text.count("\n") == 1 and f"{CLEAR}  [kit] SFT checkpoint abc: held-out accuracy 0.312\n" in text
    assert text.endswith(CLEAR)
