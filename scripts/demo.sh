#!/usr/bin/env bash
# The README's first command: set up, then run the demo (tiny kit, SFT warm start, GRPO on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Prefect's INFO lines reach the run's logs in the UI (rlstage ui), only its warnings the terminal.
export PYTHONUNBUFFERED=1 PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=${PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL:-WARNING}
exec .venv/bin/rlstage demo "$@"
