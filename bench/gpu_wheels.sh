#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on the GPU machine (Python 3.12, x86-64, no package registry there):
# what rlstage.engines imports and that machine's image lacks. ~2.8 MB in all, into .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
# DeepSpeed (the deepspeed section): the installed pure-Python package and hjson, without bytecode (11 MB);
# there: PYTHONPATH=/tmp/site:$PWD/.whl/py
SP=$("$PY" -c 'import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("deepspeed").origin)))')
rm -rf .whl/py && mkdir -p .whl/py && cp -r "$SP/deepspeed" "$SP/hjson" .whl/py/
find .whl/py -name __pycache__ -type d -prune -exec rm -rf {} +
du -sh .whl
# There: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD/.whl/py \
#   python3 bench/gpu_check.py --device cuda --out "$OUT/gpu_check.json"
