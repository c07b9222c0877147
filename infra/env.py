"""Process environment for the local stack: offline, loopback-only, no telemetry."""

from __future__ import annotations

import os

LOOPBACK_DEFAULTS = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_CLI_PROMPT": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Keeps every Ray listener on 127.0.0.1 (single node) instead of probing a public address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def apply_defaults() -> None:
    for k, v in LOOPBACK_DEFAULTS.items():
        os.environ.setdefault(k, v)
