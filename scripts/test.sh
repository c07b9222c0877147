#!/usr/bin/env bash
# The README's second command: set up, then run every test (unit + Prefect/Ray/MLflow integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/ruff check .
# Two workers by default (RLSTAGE_TEST_WORKERS): much of a test's time is spent starting servers and
# engines on one core; a module stays on one worker, the longest first (tests/conftest.py).
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${RLSTAGE_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --durations=25 "$@"
