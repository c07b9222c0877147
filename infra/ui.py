"""``rlstage ui``: the Prefect UI and the MLflow UI on the runs of the local home (``infra/home.py``).

A server that the stack (or another ``rlstage ui``) already runs on the home is reused; the others are
started on 127.0.0.1, recorded under ``<home>/stack`` (so that ``rlstage train`` and ``infra/stack.sh`` use
them meanwhile) and stopped when the command ends.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from infra import home
from infra.env import apply_defaults, free_port
from infra.prefect_server import die_with_parent, start_prefect_server, stop_process_group, wait_http


def start_mlflow_server(directory: Path, port: int, log_path: Path | None = None) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1 over ``<directory>/mlflow.db``, its output appended to ``log_path``
    (default: the home's ``stack/mlflow.log``); returns without waiting for it."""
    apply_defaults()  # MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: ~540 MiB instead of ~1.3 GiB
    (directory / "artifacts").mkdir(parents=True, exist_ok=True)
    log = open(log_path or home.state_dir() / "mlflow.log", "ab")  # noqa: SIM115 - the server process owns it
    cmd = [
        str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
        "--artifacts-destination", str(directory / "artifacts"),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
    )


def _port(what: str, wanted: int) -> int:
    port = free_port(wanted)
    if port != wanted:
        print(f"rlstage ui: port {wanted} is taken; the {what} UI uses port {port}", file=sys.stderr, flush=True)
    return port


def serve(prefect_port: int, mlflow_port: int) -> int:
    """Both UIs until SIGINT/SIGTERM (or until a server this command started exits)."""
    home.state_dir().mkdir(parents=True, exist_ok=True)
    started: list[tuple[str, subprocess.Popen, int]] = []  # (service, process, port)
    try:
        mlflow_url = home.running_service(home.MLFLOW_SERVICE)
        if mlflow_url is None:  # started first: it takes the longer to answer
            port = _port("MLflow", mlflow_port)
            started.append((home.MLFLOW_SERVICE, start_mlflow_server(home.mlflow_dir(), port), port))
            mlflow_url = home.service_url(home.MLFLOW_SERVICE, port)
        prefect_url = home.running_service(home.PREFECT_SERVICE)
        if prefect_url is None:
            port = _port("Prefect", prefect_port)
            server = start_prefect_server(home.prefect_home(), port, timeout_s=120, ui=True)
            started.append((home.PREFECT_SERVICE, server.proc, port))
            prefect_url = server.url
        for name, proc, port in started:
            if name == home.MLFLOW_SERVICE:
                wait_http(f"{mlflow_url}/health", 120, proc)
            home.record_service(name, proc, port)
        print(f"Prefect UI: {prefect_url.removesuffix('/api')}", flush=True)
        # MLflow 3's UI opens in its GenAI mode (a per-browser setting) unless the link names the mode.
        print(f"MLflow UI:  {mlflow_url}/#/experiments?workflowType=machine_learning", flush=True)
        if not started:
            print(f"(both run on {home.home()} already; rlstage ui leaves them running)", file=sys.stderr)
            return 0
        while all(proc.poll() is None for _, proc, _ in started):
            time.sleep(0.5)
        name = next(name for name, proc, _ in started if proc.poll() is not None)
        print(f"rlstage ui: the {name} server exited (log: {home.state_dir()})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (flows/cli.py): stop what this command started
        return 0
    finally:
        for name, proc, _ in reversed(started):
            home.forget_service(name, proc)
            stop_process_group(proc)
