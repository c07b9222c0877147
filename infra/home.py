"""One local home for every run: the Prefect home and the MLflow store that the demo, the CLI, the stack
(``infra/stack.sh``) and ``rlstage ui`` share, so that a run is visible in both UIs whichever path ran it.

    <home>/prefect/          PREFECT_HOME: Prefect's database (flow runs, logs, artifacts)
    <home>/mlflow/mlflow.db  the MLflow tracking store; <home>/mlflow/artifacts: the server's artifacts
    <home>/stack/            pids, ports and logs of the servers that run on this home (stack.sh, rlstage ui)

``<home>`` is ``RLSTAGE_HOME``, else ``.rlstage`` in the current directory (the repository root in the README).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from rlstage.infra.env import pid_alive

HOME_ENV = "RLSTAGE_HOME"
# The names under which stack.sh (and rlstage ui) record a server: <home>/stack/<name>.pid and .port.
PREFECT_SERVICE, MLFLOW_SERVICE, RAY_SERVICE = "prefect-server", "mlflow", "ray"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or ".rlstage").expanduser().resolve()


def prefect_home() -> Path:
    return home() / "prefect"


def mlflow_dir() -> Path:
    return home() / "mlflow"


def mlflow_uri() -> str:
    return f"sqlite:///{mlflow_dir() / 'mlflow.db'}"


def state_dir() -> Path:
    return home() / "stack"


def service_url(name: str, port: int) -> str:
    return f"http://127.0.0.1:{port}" + ("/api" if name == PREFECT_SERVICE else "")


def _running_port(name: str) -> int | None:
    """The port of the service ``name`` that runs on this home (recorded pid alive and leading its session)."""
    try:
        pid = int((state_dir() / f"{name}.pid").read_text())
        port = int((state_dir() / f"{name}.port").read_text())
    except (OSError, ValueError):
        return None
    try:
        if not pid_alive(pid) or os.getsid(pid) != pid:  # a reused pid: not the session that was recorded
            return None
    except OSError:
        return None
    return port


def running_service(name: str) -> str | None:
    """The URL of the server ``name`` that runs on this home."""
    port = _running_port(name)
    return None if port is None else service_url(name, port)


def running_ray() -> tuple[str, str] | None:
    """The address and token of the Ray head that runs on this home (``infra/stack.sh up``), or None."""
    port = _running_port(RAY_SERVICE)
    try:
        token = (state_dir() / "ray.token").read_text().strip()
    except OSError:
        return None
    return None if port is None else (f"127.0.0.1:{port}", token)


def record_service(name: str, proc: subprocess.Popen, port: int) -> None:
    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / f"{name}.port").write_text(f"{port}\n")
    (state_dir() / f"{name}.pid").write_text(f"{proc.pid}\n")


def forget_service(name: str, proc: subprocess.Popen) -> None:
    """Remove the record of ``name`` if it is still ``proc``'s (the port file stays: the next start prefers it)."""
    pidfile = state_dir() / f"{name}.pid"
    try:
        if int(pidfile.read_text()) == proc.pid:
            pidfile.unlink()
    except (OSError, ValueError):
        pass


OWNER_ENV = "RLSTAGE_OWNER_PID"  # set by each command: every process it starts (Prefect, Ray, workers) inherits it


def process_environs() -> Iterator[tuple[int, dict[bytes, bytes]]]:
    """Every other process of this user with its environment (Linux's /proc; nothing elsewhere)."""
    for proc in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            raw = (proc / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        yield int(proc.name), dict(entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)


def stop_leftovers(prefect_home: Path) -> list[int]:
    """SIGKILL the processes that a command on this home started and that outlived it (it was killed: its Prefect
    server's uvicorn, Ray's agents). Found by their environment: this home, and an owner command that is gone."""
    import signal

    ours, home_entry = str(os.getpid()).encode(), str(prefect_home.resolve()).encode()
    stopped = []
    for pid, env in process_environs():
        owner = env.get(OWNER_ENV.encode(), b"")
        if env.get(b"PREFECT_HOME") != home_entry or not owner.isdigit() or owner == ours or pid_alive(int(owner)):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
        except OSError:
            pass
    return stopped
