"""A real Prefect API server on 127.0.0.1, started in its own process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlstage.infra.db_templates import seed_prefect_home
from rlstage.infra.env import apply_defaults, free_port, pid_alive


class ServerFailedToStart(RuntimeError):
    """A local server this command started kept exiting during its own start."""


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | int | None = None) -> None:
    """Until ``url`` answers below 500 (a ``tcp://host:port`` URL: until the port accepts a connection, as a Ray head
    does); fails early when ``proc`` (a Popen or a pid) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with code {proc.returncode}")
        if isinstance(proc, int) and not pid_alive(proc):
            raise RuntimeError(f"server for {url} exited before it answered")
        try:
            if url.startswith("tcp://"):
                host, _, port = url.removeprefix("tcp://").rpartition(":")
                socket.create_connection((host, int(port)), timeout=2).close()
                return
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group of ``proc`` (its leader dead or not)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class PrefectServer:
    url: str
    proc: subprocess.Popen
    home: Path

    def stop(self) -> None:
        stop_process_group(self.proc)


class ServerKeeper(threading.Thread):
    """Starts ``server`` again, on its home and port, when its process dies while the command runs: checked every
    ``poll_s`` seconds, at most ``max_restarts`` times, each said in one line. The command's Prefect client
    retries its calls meanwhile (PREFECT_CLIENT_MAX_RETRIES), so the flow run goes on where it was."""

    def __init__(self, server: PrefectServer, say: Callable[[str], None], max_restarts: int = 3, poll_s: float = 2.0):
        super().__init__(name="rlstage-prefect-keeper", daemon=True)
        self.server, self.say, self.max_restarts, self.poll_s = server, say, max_restarts, poll_s
        self.restarts = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        port = int(self.server.url.rsplit(":", 1)[1].split("/")[0])
        while not self._stopping.wait(self.poll_s):
            if self.server.proc.poll() is None:
                continue
            if self.restarts == self.max_restarts:
                self.say(f"the Prefect server this command started stopped again; {self.max_restarts} restarts are spent")
                return
            self.restarts += 1
            kill_process_group(self.server.proc)  # what the dead server started would hold the port, answering for it
            try:
                proc = spawn_prefect_server(self.server.home, port)
                wait_http(prefect_health(port), 90.0, proc)
            except (OSError, RuntimeError, TimeoutError) as err:
                self.say(f"the Prefect server this command started stopped, and could not be started again: {err}")
                return
            self.server.proc = proc
            self.say(
                f"the Prefect server this command started stopped; started again on port {port} "
                f"(restart {self.restarts} of {self.max_restarts})"
            )

    def stop(self) -> None:
        self._stopping.set()
        self.join()


def retry_refused_connections() -> None:
    """Prefect's clients retry a refused connection (with backoff, PREFECT_CLIENT_MAX_RETRIES) only once they
    have connected; a client made while the command's own server restarts would fail at once. The command
    knows its server comes back (``ServerKeeper``), so its clients retry from their first call. (Prefect 3.8's
    ``_has_connected`` flag; where a version lacks it nothing changes.)"""
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    for cls in (PrefectHttpxAsyncClient, PrefectHttpxSyncClient):
        if getattr(cls.__init__, "_rlstage_retrying", False):
            continue
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs) -> None:
            _original(self, *args, **kwargs)
            if hasattr(self, "_has_connected"):
                self._has_connected = True

        init._rlstage_retrying = True
        cls.__init__ = init


# A 503 from a local server is SQLite's "database is locked" (two writers met: Prefect's task-run recorder and a
# create_task_run request, about once per iteration), which clears in milliseconds; Prefect's clients wait 2**n s
# before retry n (2, 4, 8, 16, 32). On the loopback server they wait (2**n)**2 / 32 s instead: 0.125, 0.5, 2, 8,
# 32 — the first retry at once, and still ~43 s in all, so that a server that restarts (ServerKeeper) is waited for.


def quick_retries_on_a_local_server() -> None:
    """In this process, Prefect's API clients retry a loopback server's 503 after ~0.1 s instead of ~2 s (measured:
    ~2 s of every tiny iteration's wall was that wait). Nothing changes for another server."""
    import prefect.client.base as base
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or os.environ.get("PREFECT_API_URL", "")
    if getattr(base.clamped_poisson_interval, "_rlstage_local", False) or not url.startswith("http://127.0.0.1:"):
        return
    original = base.clamped_poisson_interval

    def sooner(average_interval: float, clamping_factor: float = 0.3) -> float:
        return original(average_interval * average_interval / 32, clamping_factor)

    sooner._rlstage_local = True
    sooner.__wrapped__ = original
    base.clamped_poisson_interval = sooner


def prefect_env(home: Path, ui_port: int | None = None) -> dict[str, str]:
    """The server's environment; with ``ui_port`` its UI is on and calls the API of that port (the UI's
    default is port 4200, whatever port the server runs on)."""
    apply_defaults()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"}
    if ui_port:
        env.update(PREFECT_UI_ENABLED="true", PREFECT_UI_API_URL=f"http://127.0.0.1:{ui_port}/api")
    else:  # a command's own server, gone with the command: only the services a flow run needs
        for service in UNUSED_SERVICES:
            env.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


# Services of a long-lived server (schedules, workers, automations, pauses, cancellations, leases) that a server
# living as long as one command never uses; each polls the database every few seconds: an idle server here took
# 4.0-5.5 CPU-s a minute with them, 2.2-2.5 without. Kept: the event persister and task-run recorder (a flow's
# task runs are recorded from its events). A setting in the environment wins (tests/integration/test_schedule.py).
UNUSED_SERVICES = (
    "SCHEDULER", "LATE_RUNS", "FOREMAN", "TRIGGERS", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR",
    "CLEANUP_RECONCILER",
)  # fmt: skip


def die_with_parent() -> None:
    """In the server's process: get SIGTERM when the process that started it dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def port_taken(port: int) -> bool:
    try:
        free_port(port, strict=True)
    except OSError:
        return True
    return False


def wait_up(
    spawn: Callable[[int], subprocess.Popen],
    port: int,
    health: Callable[[int], str],
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    moved: Callable[[int, int], None] | None = None,
    restarted: Callable[[str, int], None] | None = None,
) -> tuple[subprocess.Popen, int]:
    """Wait until ``proc`` (else ``spawn(port)``) answers at ``health(port)``; returns the process and its port.

    A free port can be bound by another process before the server binds it (a loaded machine: CI saw a server
    exit so). Where ``moved`` is given, a server that exited while its port is taken is started again on
    another free port, twice at most, and ``moved(old, new)`` told. A server that exits during its start otherwise
    (killed, crashed) is started again on its port, twice at most (``restarted(why, try)`` told), then
    ServerFailedToStart; a timeout or a signal stops it and raises.
    """
    moves = restarts = 0
    while True:
        proc = proc or spawn(port)
        try:
            wait_http(health(port), timeout_s, proc)
            return proc, port
        except RuntimeError as err:  # it exited
            if moved is None or moves == 2 or not port_taken(port):
                # killed or crashed during its own start (not a taken port): started again, twice at most
                if restarts == 2:
                    raise ServerFailedToStart(f"{err} during its start, three times") from None
                kill_process_group(proc)  # what the dead server started would hold its port
                restarts, proc = restarts + 1, None
                if restarted is not None:
                    restarted(str(err), restarts + 1)
                continue
        except BaseException:  # a timeout, or a signal while waiting: nothing started here outlives the call
            stop_process_group(proc)
            raise
        new = free_port()
        moved(port, new)
        port, proc, moves = new, None, moves + 1


def spawn_prefect_server(home: Path, port: int, ui: bool = False) -> subprocess.Popen:
    """``prefect server start`` on 127.0.0.1 with its state under ``home`` (and its UI when ``ui``); no wait."""
    home.mkdir(parents=True, exist_ok=True)
    seed_prefect_home(home)  # a new home's database starts migrated (infra/db_templates.py)
    log = open(home / "server.log", "ab")  # noqa: SIM115 - the server process owns it
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=prefect_env(home, port if ui else None),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def prefect_health(port: int) -> str:
    return f"http://127.0.0.1:{port}/api/health"


def _say_restarted(why: str, attempt: int) -> None:
    print(f"rlstage: the Prefect server this command starts died during its start ({why}); starting it again "
          f"(try {attempt} of 3)", file=sys.stderr, flush=True)  # fmt: skip


def start_prefect_server(
    home: str | Path,
    port: int | None = None,
    timeout_s: float = 90.0,
    ui: bool = False,
    meanwhile: Callable[[str], None] | None = None,
) -> PrefectServer:
    """Start ``prefect server start`` on ``port`` (default: a free one, another if it is taken meanwhile) and
    wait until healthy. ``meanwhile(url)`` runs once the server process is spawned, while it boots (~5-10 s of
    its own CPU here): what the caller would start after it (Ray, whose workers inherit ``url``) starts beside it."""
    home = Path(home).resolve()
    chosen, port = port, port or free_port()
    proc = spawn_prefect_server(home, port, ui)
    if meanwhile is not None:
        try:
            meanwhile(f"http://127.0.0.1:{port}/api")
        except BaseException:
            stop_process_group(proc)
            raise
    proc, port = wait_up(
        lambda p: spawn_prefect_server(home, p, ui), port, prefect_health, timeout_s, proc=proc,
        moved=None if chosen else (lambda old, new: None), restarted=_say_restarted,
    )  # fmt: skip
    return PrefectServer(url=f"http://127.0.0.1:{port}/api", proc=proc, home=home)


if __name__ == "__main__":
    # For infra/stack.sh:  port PREFERRED [strict]  |  wait URL TIMEOUT_S PID
    try:
        if sys.argv[1] == "port":
            print(free_port(int(sys.argv[2]), sys.argv[3:] == ["strict"]))
        else:
            wait_http(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    except (OSError, RuntimeError, TimeoutError) as err:
        sys.exit(f"stack: {err}")
