"""What a command prints while it runs. Summary lines always; stage detail as lines under ``--verbose``
(``RLSTAGE_VERBOSE=1``), else, on a terminal, as one status line rewritten in place with the time it has
taken and what long work reports (``infra/progress.py``); elsewhere (logs, CI) not at all."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

CLEAR = "\r\x1b[K"  # back to the line's start, erase it
TICK_S = 1.0


def verbose() -> bool:
    return os.environ.get("RLSTAGE_VERBOSE", "") not in ("", "0")


class Terminal:
    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self._stream, self._live = stream, live
        self.status_text: str | None = None
        self.since = 0.0
        self.note: str | None = None  # what the running work reported last
        self.read_note = None  # () -> str | None, while long work can report
        self.lock = threading.Lock()
        self.ticker: threading.Thread | None = None

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr  # looked up late: a test's capture replaces sys.stderr

    @property
    def live(self) -> bool:
        if self._live is None:
            tty = getattr(self.stream, "isatty", lambda: False)()
            self._live = tty and os.environ.get("TERM") != "dumb"
        return self._live

    def line(self, text: str) -> None:
        """A line that stays: the status line is erased before it and redrawn after it."""
        with self.lock:
            self.stream.write((CLEAR if self.live and self.status_text else "") + text + "\n")
            self._draw()

    def status(self, text: str | None, read_note=None) -> None:
        """What runs now (None: nothing); ``read_note`` polls what it reports."""
        if verbose():
            if text:
                self.line(text)
            return
        if not self.live:
            return
        with self.lock:
            self.status_text, self.since, self.note, self.read_note = text, time.monotonic(), None, read_note
            if text is None:
                self.stream.write(CLEAR)
                self.stream.flush()
            else:
                self._draw()
        if self.ticker is None:
            self.ticker = threading.Thread(target=self._tick, name="rlstage-terminal", daemon=True)
            self.ticker.start()

    def _draw(self) -> None:
        if self.live and self.status_text:
            note = f" · {self.note}" if self.note else ""
            self.stream.write(f"{CLEAR}{self.status_text} {time.monotonic() - self.since:.0f}s{note}")
        self.stream.flush()

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            reader = self.read_note
            note = None
            if reader is not None:
                try:
                    note = reader()
                except Exception:  # a display must never stop the run
                    note = None
            with self.lock:
                if note:
                    self.note = note
                self._draw()


TERMINAL = Terminal()
