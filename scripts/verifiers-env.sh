#!/usr/bin/env bash
# A Python environment for verifiers tasksets (data.source: verifiers): verifiers' pins cannot share rlstage's
# environment, so its tasksets run in this one, behind a process boundary. Usage: bash scripts/verifiers-env.sh
# [DIR] [PACKAGE...] (DIR default .venv-verifiers; PACKAGEs: the tasksets to install beside verifiers). Prints the
# interpreter to export as RLSTAGE_VERIFIERS_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-verifiers}
shift || true
# verifiers, and uv beside it: verifiers' chat harness sets its program up with uv.
PACKAGES=(verifiers==0.4.0 uv==0.13.9 "$@")
# rlstage's environment has uv, which installs them in seconds; plain venv + pip otherwise.
UV=$(command -v .venv/bin/uv || command -v uv || true)
if [ -n "$UV" ]; then
  [ -x "$DIR/bin/python" ] || "$UV" venv -q --python "$(command -v python3)" "$DIR" >&2
  "$UV" pip install -q --python "$DIR/bin/python" "${PACKAGES[@]}" >&2
else
  [ -x "$DIR/bin/pip" ] || python3 -m venv "$DIR" >&2
  "$DIR/bin/pip" install -q "${PACKAGES[@]}" >&2
fi
echo "$(cd "$DIR" && pwd)/bin/python"
