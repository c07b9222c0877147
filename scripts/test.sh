#!/usr/bin/env bash
# The README's second command: set up, then run every test (unit + Prefect/Ray/MLflow integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/ruff check .
# Three workers by default (RLSTAGE_TEST_WORKERS) on two cores: half of a test's time is spent waiting on
# servers and processes it started (CPU busy 46% of the wall with two workers); a module stays on one
# worker, the longest first (tests/conftest.py).
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${RLSTAGE_TEST_WORKERS:-3}" --dist loadfile \
    --no-loadscope-reorder --durations=25 "$@"
