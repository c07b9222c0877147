"""The built wheel installs one import name, ``rlstage``, and its demo runs from an empty directory.

The wheel is built from a copy of the source tree and installed without dependencies into a fresh virtual
environment that borrows this environment's packages (torch, Prefect, Ray, ... as a plain path, so this
checkout's editable install is not active there): what runs is the wheel's code and data alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

from tests_support import REPO, build_wheel, env_with_wheel, tiny_overrides

LEGACY = ("schemas", "engines", "workers", "tasks", "flows", "infra")  # our top-level names before 0.2.0


def test_wheel_installs_one_import_name_and_runs_the_demo(tmp_path, prefect_api):
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", ".ruff_cache", ".whl", ".trl-venv")
    shutil.copytree(REPO, src, ignore=skip)
    wheel = build_wheel(src, tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = next(t for t in top if t.endswith(".dist-info"))
    assert top == {"rlstage", dist_info}, top
    assert "rlstage/configs/demo.yaml" in names and "rlstage/engines/algorithms/losses.py" in names
    # every package of the tree is in the wheel (pyproject.toml lists them)
    packages = {f"rlstage/{p.relative_to(REPO).as_posix()}" for top in LEGACY for p in (REPO / top).rglob("__init__.py")}
    assert packages <= set(names), sorted(packages - set(names))
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "rlstage = rlstage.flows.cli:main" in entry_points
    assert "rlstage.engines.rollout.vllm_plugin:register" in entry_points

    env_dir = tmp_path / "env"
    py = env_with_wheel(wheel, env_dir)

    empty = tmp_path / "empty"
    empty.mkdir()
    # the test session's Prefect API (PREFECT_API_URL, as a deployment gives it; a server of the command's own is
    # what test_ui and test_bad_input start): the demo's own work is what this test times
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_HOME", "RLSTAGE_", "MLFLOW_", "PYTHONPATH"))}
    env["RLSTAGE_HOME"] = str(tmp_path / "home")
    probe = f"import importlib.util as u, rlstage; print(rlstage.__file__); print([n for n in {LEGACY!r} if u.find_spec(n)])"
    seen = subprocess.run([py, "-c", probe], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    where, legacy = seen.stdout.strip().splitlines()
    assert Path(where).is_relative_to(env_dir), where  # the wheel's copy, not this checkout
    assert legacy == "[]"  # `import schemas` (and the rest) fails there
    failed = subprocess.run([py, "-c", "import schemas"], cwd=empty, env=env, capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "No module named 'schemas'" in failed.stderr

    # `rlstage demo` with a short setting: the demo config travels inside the package
    args = [*tiny_overrides(), "trainer.iterations=1", "data.eval_size=20"]
    demo = subprocess.run([env_dir / "bin" / "rlstage", "demo", *args], cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, (demo.stdout[-2000:], demo.stderr[-3000:])
    assert "learning: " in demo.stdout and "artifacts: " in demo.stdout, demo.stdout[-2000:]
    artifacts = Path(demo.stdout.split("artifacts: ", 1)[1].splitlines()[0])
    assert (artifacts if artifacts.is_absolute() else empty / artifacts).is_dir()
