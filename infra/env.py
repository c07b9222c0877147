"""Process environment for the local stack: offline, loopback-only, no telemetry."""

from __future__ import annotations

import os
import socket
from pathlib import Path

LOOPBACK_DEFAULTS = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_CLI_PROMPT": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    # A tracking server that went away costs seconds, not MLflow's default minutes of retries per call:
    # the run goes on and its metrics are logged once the server answers (infra/tracking.py).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Keeps every Ray listener on 127.0.0.1 (single node) instead of probing a public address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Writing model shards" bar on every checkpoint
    "AWS_EC2_METADATA_DISABLED": "true",
}


def pid_alive(pid: int) -> bool:
    """Whether a process of this machine lives (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_running(pid: int) -> bool:
    """Whether a process lives and is not a zombie (exited, its parent yet to reap it: ``pid_alive`` counts those)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return os.path.exists(f"/proc/{pid}")


def apply_defaults() -> None:
    for k, v in LOOPBACK_DEFAULTS.items():
        os.environ.setdefault(k, v)
    # With no NVIDIA device DeepSpeed warns at every import that it "was unable to detect" one: name the CPU.
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port(prefer: int = 0, strict: bool = False, host: str = "127.0.0.1") -> int:
    """``prefer`` when it is free on ``host``, else (unless ``strict``) a port the kernel picks. The one
    free-port helper: servers of the stack and ``rlstage ui``, torch.distributed's MASTER_PORT.

    SO_REUSEADDR as the servers bind: a port whose last connections are in TIME_WAIT counts as free.
    """
    for port in (prefer,) if strict else dict.fromkeys((prefer, 0)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"port {prefer} on {host} is in use")
