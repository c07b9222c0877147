"""``rlstage ui``: the Prefect UI and the MLflow UI on the runs of the local home (``infra/home.py``).

A server that the stack (or another ``rlstage ui``) already runs on the home is reused; the others are
started on 127.0.0.1, recorded under ``<home>/stack`` (so that ``rlstage train`` and ``infra/stack.sh`` use
them meanwhile) and stopped when the command ends.
"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from rlstage.infra import home
from rlstage.infra.db_templates import seed
from rlstage.infra.env import apply_defaults, free_port
from rlstage.infra.prefect_server import die_with_parent, spawn_prefect_server, stop_process_group, wait_up


def start_mlflow_server(directory: Path, port: int, log_path: Path | None = None) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1 over ``<directory>/mlflow.db``, its output appended to ``log_path``
    (default: the home's ``stack/mlflow.log``); returns without waiting for it."""
    apply_defaults()  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: ~540 MiB instead of ~1.3 GiB
    (directory / "artifacts").mkdir(parents=True, exist_ok=True)
    seed("mlflow", directory / "mlflow.db")  # a new home's store starts migrated (infra/db_templates.py)
    log = open(log_path or home.state_dir() / "mlflow.log", "ab")  # noqa: SIM115 - the server process owns it
    cmd = [
        str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
        "--artifacts-destination", str(directory / "artifacts"),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
    )


def _say(line: str) -> None:
    print(f"rlstage ui: {line}", file=sys.stderr, flush=True)


def _spawn(name: str, port: int) -> subprocess.Popen:
    if name == home.MLFLOW_SERVICE:
        return start_mlflow_server(home.mlflow_dir(), port)
    return spawn_prefect_server(home.prefect_home(), port, ui=True)


def _health(name: str, port: int) -> str:
    return f"{home.service_url(name, port)}/health"


def serve(prefect_port: int, mlflow_port: int) -> int:
    """Both UIs until SIGINT/SIGTERM (or until a server this command started exits)."""
    home.state_dir().mkdir(parents=True, exist_ok=True)
    wanted = {home.MLFLOW_SERVICE: ("MLflow", mlflow_port), home.PREFECT_SERVICE: ("Prefect", prefect_port)}
    urls = {name: home.running_service(name) for name in wanted}
    started: dict[str, tuple[subprocess.Popen, int]] = {}  # service -> (process, port)
    try:
        for name, (what, preferred) in wanted.items():  # both start at once, MLflow first: it answers later
            if urls[name] is None:
                if (port := free_port(preferred)) != preferred:
                    _say(f"port {preferred} is taken; the {what} UI uses port {port}")
                started[name] = (_spawn(name, port), port)
        for name in sorted(started, key=lambda name: name == home.MLFLOW_SERVICE):
            what = wanted[name][0]
            proc, port = started.pop(name)  # where it fails, wait_up has stopped it
            started[name] = wait_up(
                partial(_spawn, name), port, partial(_health, name), 120, proc,
                moved=lambda old, new, what=what: _say(f"port {old} was taken meanwhile; the {what} UI uses port {new}"),
            )  # fmt: skip
            home.record_service(name, *started[name])
            urls[name] = home.service_url(name, started[name][1])
        print(f"Prefect UI: {urls[home.PREFECT_SERVICE].removesuffix('/api')}", flush=True)
        # MLflow 3's UI opens in its GenAI mode (a per-browser setting) unless the link names the mode.
        print(f"MLflow UI:  {urls[home.MLFLOW_SERVICE]}/#/experiments?workflowType=machine_learning", flush=True)
        if not started:
            print(f"(both run on {home.home()} already; rlstage ui leaves them running)", file=sys.stderr)
            return 0
        while all(proc.poll() is None for proc, _ in started.values()):
            time.sleep(0.5)
        name = next(name for name, (proc, _) in started.items() if proc.poll() is not None)
        _say(f"the {name} server exited (log: {home.state_dir()})")
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (flows/cli.py): stop what this command started
        return 0
    finally:
        for name, (proc, _) in started.items():
            home.forget_service(name, proc)
            stop_process_group(proc)
