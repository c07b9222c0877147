#!/usr/bin/env bash
# The README's first command: set up, then run the demo (tiny kit, SFT warm start, GRPO on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1 PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-WARNING}
exec .venv/bin/rlstage demo "$@"
