"""A run written by the previous release (CHANGELOG.md names its commit) is continued, replayed and evaluated
by this code: nothing committed is trained again, the replay reproduces the stored bytes, and each MLflow
metric step is logged once.

The previous release is built from this repository's own history (``git archive`` of its commit) into a wheel,
installed into an environment of its own, and its CLI writes a one-iteration run (store + MLflow database).
Every release keeps this test against its predecessor: update ``CHANGELOG.md``'s newest released section.
Stores written by the unreleased main since ``MAIN_STORES`` are checked the same way: the stage contracts were
rewritten after it (each declared once, schemas/stages.py), and its stores' cache keys must hold.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests_support import (
    REPO,
    build_wheel,
    env_with_wheel,
    moving_overrides,
    tiny_overrides,
    update_weights,
    weights_moved,
)

RUN = "upgraded"
MAIN_STORES = ("0.2.0.dev0", "f4444b1")  # (version, commit): main before the stage contracts were declared once


def previous_release() -> tuple[str, str]:
    """(version, commit) of the newest released section of CHANGELOG.md (``## X.Y.Z — commit ABC``)."""
    found = re.search(r"^## (\d+\.\d+\.\d+) — commit ([0-9a-f]{7,40})$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert found, "CHANGELOG.md names no released version with its commit"
    return found.group(1), found.group(2)


def _source_of(commit: str, dest: Path) -> Path:
    have = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True)
    if have.returncode != 0:
        pytest.fail(f"the previous release's commit {commit} is not in this clone's history (a shallow clone?)")
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _late_setting(path: str) -> bool:
    """Whether the dotted config ``path`` is a setting added after runs were stored (HASHED_WHEN_SET)."""
    from rlstage.schemas.config import FLAT_PATHS, HASHED_WHEN_SET, RunConfig

    path = {flat: nested for nested, flat in FLAT_PATHS.items()}.get(path, path)  # a flat name's param
    model, *parents, leaf = [RunConfig, *path.split(".")]
    for part in parents:
        model = model.model_fields[part].annotation
    return (model.model_fields[leaf].json_schema_extra or {}) == HASHED_WHEN_SET


@pytest.mark.parametrize("written_by", ["previous release", "main"])
def test_a_run_of_the_previous_release_continues_replays_and_evaluates(prefect_api, tmp_path, written_by):
    from mlflow import MlflowClient

    from rlstage.flows.evaluate import evaluate_run
    from rlstage.flows.nightly import nightly
    from rlstage.flows.replay import replay
    from rlstage.infra.store import ArtifactStore

    version, commit = previous_release() if written_by == "previous release" else MAIN_STORES
    # 0.1.0 installed its modules at the top level (engines, flows, ...); later code is one package, rlstage
    top = "" if version == "0.1.0" else "rlstage."
    old_py = env_with_wheel(build_wheel(_source_of(commit, tmp_path / "prev"), tmp_path / "dist"), tmp_path / "env")
    store_root, db = tmp_path / "store", tmp_path / "mlflow.db"
    args = [*tiny_overrides(), *moving_overrides(), "trainer.iterations=1", f"run_name={RUN}", f"store.root={store_root}"]
    args.append(f"tracking.tracking_uri=sqlite:///{db}")
    # the test session's Prefect API (PREFECT_API_URL), as a deployment would give it: no server of its own to start
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_HOME", "RLSTAGE_", "MLFLOW_", "PYTHONPATH"))}
    env["RLSTAGE_HOME"] = str(tmp_path / "home")
    (work := tmp_path / "work").mkdir()
    old = subprocess.run([old_py, "-m", f"{top}flows.cli", "train", *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert old.returncode == 0, (version, old.stdout[-2000:], old.stderr[-3000:])
    probe = f"import {top}engines, importlib.metadata as m; print(m.version('rlstage'))"
    shown = subprocess.run([old_py, "-c", probe], cwd=work, env=env, capture_output=True, text=True)
    assert shown.stdout.strip() == version, shown.stderr[-2000:]  # the run was written by that release's code

    store = ArtifactStore(str(store_root))
    before = {s: store.manifest(RUN, 1, s) for s in ("rollout", "reward", "advantage", "update")}
    assert all(before.values()), before
    client = MlflowClient(f"sqlite:///{db}")
    (old_run,) = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()]) if r.info.run_name == RUN]
    old_params = dict(old_run.data.params)

    # nightly: one more iteration with the stored config; iteration 1's committed stages are reused, not retrained
    result = nightly(run_name=RUN, iterations=1, store_root=str(store_root))
    assert not [e for e in result["executed"] if e.startswith("iter-1/")], result["executed"]
    assert any(e.startswith("iter-2/") for e in result["executed"]), result["executed"]
    assert {s: store.manifest(RUN, 1, s) for s in before} == before
    assert weights_moved(update_weights(store, RUN, 1), update_weights(store, RUN, 2))

    # replay of the old release's update: the same bytes
    summary = replay(run_name=RUN, iteration=1, stage="update", store_root=str(store_root))
    assert summary["identical"], summary
    evaluated = evaluate_run(run_name=RUN, iteration=1, store_root=str(store_root))
    assert 0.0 <= evaluated["metrics"]["val/accuracy"] <= 1.0, evaluated

    # MLflow: the old and the new process logged into one run, each step of a metric once; its params are the old
    # release's, untouched, and a run started now with the same config logs them under the same keys and values
    # (plus the settings added since, HASHED_WHEN_SET)
    from rlstage.flows.checks import stored_config
    from rlstage.infra.tracking import config_params

    assert dict(client.get_run(old_run.info.run_id).data.params) == old_params
    now = config_params(stored_config(store, RUN))
    assert {k: now[k] for k in old_params} == old_params
    late = {k for k in set(now) - set(old_params) if not _late_setting(k)}
    assert not late, late
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    trained = [r for r in runs if "val/accuracy" in r.data.metrics]
    assert trained, [r.info.run_name for r in runs]
    for run in trained:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/accuracy")]
        assert len(steps) == len(set(steps)), (run.info.run_name, steps)
