#!/usr/bin/env bash
# The README's second command: set up, then run every test (unit + Prefect/Ray/MLflow integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
