#!/usr/bin/env bash
# Create .venv and install rlstage with its pinned stack (CPU torch first: see ../shared/notes/stack.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # Elsewhere, TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the CPU build.
  .venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
fi
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -vE "^WARNING: Location .* is ignored" || true
.venv/bin/python -c "import torch, prefect, ray, mlflow, transformers, deepspeed, pyarrow, polars; print('rlstage: environment ready (torch', torch.__version__ + ')')"
