"""Process environment for the local stack: offline, loopback-only, no telemetry."""

from __future__ import annotations

import os

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


def apply_defaults() -> None:
    for k, v in LOOPBACK_DEFAULTS.items():
        os.environ.setdefault(k, v)
