"""The shared harness itself (tests_support.py): the chaos schedule's refusals and determinism, and the check of
what a run leaves in /dev/shm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests_support import KINDS, ScheduleError, orphaned_shm, schedule, shm_files


def test_a_bad_schedule_is_one_line():
    for seed, kinds, choose, says in [
        ("7", 3, KINDS, "chaos seed must be an integer, got '7'"),
        (0, 9, KINDS, "chaos kinds: 9 is not 1..5 of command, prefect_server"),
        (0, 1, ("mlflow_server_x",), "chaos kinds: ['mlflow_server_x'] is not 1..1 of"),
    ]:
        with pytest.raises(ScheduleError, match=r"^" + re.escape(says)):
            schedule(seed, kinds, choose)
    assert schedule(3, 3) == schedule(3, 3) and len({k.kind for k in schedule(3, 3)}) == 3


def test_a_segment_nobody_holds_is_left_behind_and_a_held_one_is_not():
    """The check of what a run leaves in /dev/shm: another test's live engine holds its segments (not ours)."""
    before = set(os.listdir("/dev/shm"))
    left, held = Path(f"/dev/shm/rlstage-orphan-{os.getpid()}"), Path(f"/dev/shm/rlstage-held-{os.getpid()}")
    left.write_bytes(b"x")
    held.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); input()"], stdin=subprocess.PIPE)
    try:
        for _ in range(100):  # until the holder has it open
            if str(held) in shm_files([holder.pid]):
                break
            threading.Event().wait(0.1)
        assert orphaned_shm(before) == {str(left)}
    finally:
        holder.communicate(b"\n", timeout=30)
        left.unlink()
        held.unlink()
