"""Failure drills for tests: SIGKILL a process once at a point named in ``cfg.drill``."""

from __future__ import annotations

import os
import signal
import time

from rlstage.schemas.config import RunConfig


def fault_point(cfg: RunConfig, stage: str, iteration: int | None, where: str = "kill_at") -> None:
    """Failure drill: SIGKILL this process once at a point named in ``cfg.drill``.

    A marker file per point under ``drill.markers`` makes each fire once, so the retry that
    follows runs to completion.
    """
    point = f"{stage}:{iteration}"
    if not cfg.drill.markers or point not in getattr(cfg.drill, where):
        return
    try:
        fd = os.open(os.path.join(cfg.drill.markers, f"{where}-{stage}-{iteration}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_point(cfg: RunConfig, point: str, timeout_s: float = 300.0) -> None:
    """Drill: at ``point`` (one of ``cfg.drill.hold_worker_at``) announce ``held-<point>`` and wait for
    ``release-<point>`` in ``drill.markers``; a release that never comes ends the wait (the test fails). Points
    beside the role workers' and eval's: ``ray:start`` (the command's local Ray, once ``ray.init`` returned) and
    ``prefect_server:start`` (the command's Prefect server, spawned and not yet seen answering), where a test kills
    what is starting; a point released once passes at once after."""
    if not cfg.drill.markers or point not in cfg.drill.hold_worker_at:
        return
    name = point.replace(":", "-")
    open(os.path.join(cfg.drill.markers, f"held-{name}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(cfg.drill.markers, f"release-{name}")) and time.monotonic() < deadline:
        time.sleep(0.05)


class WorkerDrill:
    """A role worker's drill points: the stage task arms it with the stage and iteration its next calls
    serve, and each compute call names its role, so ``drill.kill_worker_at: ["rollout@rollout:2"]`` kills
    whichever process generates in iteration 2's rollout (rank 0 colocated, the rollout actor apart)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.at: tuple[str, int] | None = None

    def arm(self, stage: str, iteration: int) -> None:
        self.at = (stage, iteration)

    def point(self, role: str) -> None:
        if self.at is not None:
            fault_point(self.cfg, f"{self.at[0]}@{role}", self.at[1], where="kill_worker_at")
            hold_point(self.cfg, f"{self.at[0]}@{role}:{self.at[1]}")
