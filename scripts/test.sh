#!/usr/bin/env bash
# The README's second command: set up, then run every test (unit + Prefect/Ray/MLflow integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/ruff check .
# The layers of pyproject.toml's [tool.importlinter] contracts (flows -> tasks -> workers -> engines, ...)
.venv/bin/lint-imports --no-cache
# The tests' folders (stores, SQLite databases of Prefect and MLflow) in memory where /dev/shm has 8 GiB free:
# their commits wait on fsync, and on a virtual disk that left the CPUs idle (measured: the suite 10 % faster).
# RLSTAGE_TEST_BASETEMP names another folder; an empty one keeps pytest's own under /tmp.
BASETEMP=${RLSTAGE_TEST_BASETEMP-}
if [ -z "${RLSTAGE_TEST_BASETEMP+set}" ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt $((8 << 20)) ]; then
  BASETEMP=/dev/shm/rlstage-tests.$$
  trap 'rm -rf "$BASETEMP"' EXIT
fi
# Two workers by default (RLSTAGE_TEST_WORKERS): much of a test's time is spent starting servers and
# engines on one core; a module stays on one worker, the longest first (tests/conftest.py).
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${RLSTAGE_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --durations=25 ${BASETEMP:+--basetemp "$BASETEMP"} "$@"
