"""An installed plugin package (tests/plugin_pkg) trains with its loss and reward, and replays identically."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys

import pytest

# every registry exists before a test adds to it
from rlstage.engines.agents import tools as _tools  # noqa: F401
from rlstage.engines.data import datasets  # noqa: F401
from rlstage.engines.rewards import rules as rewards  # noqa: F401
from rlstage.engines.rollout import engines as rollout_engines  # noqa: F401
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import load_config
from rlstage.schemas.stages import kit_run_name
from tests_support import REPO


# ---------------------------------------------------------------- an installed plugin package, end to end
def test_an_installed_plugin_trains_with_its_loss_and_reward_and_replays_identically(prefect_api, tmp_path):
    """tests/plugin_pkg installed into the run's environment (its entry point registers it): a pipeline run names
    its loss and reward, the weights move, the run records the plugin, and the replay of its update is identical."""
    import torch

    from tests_support import tiny_overrides, update_weights, weights_moved

    site, src = tmp_path / "site", tmp_path / "plugin_pkg"
    shutil.copytree(REPO / "tests" / "plugin_pkg", src)  # setuptools writes build/ beside the sources
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
    ]
    done = subprocess.run([*install, str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = [str(site), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_HOME", "RLSTAGE_", "MLFLOW_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(path), RLSTAGE_HOME=str(tmp_path / "home"), PYTHONDONTWRITEBYTECODE="1"
    )
    store_root = tmp_path / "store"
    run = [
        "run_name=plugged",
        f"store.root={store_root}",
        *tiny_overrides(),
        "trainer.iterations=1",
        "data.eval_size=8",
    ]
    run += [
        "actor.policy_loss={name: scaled_pg, scale: 4.0}",
        "algorithm.adv_estimator=grpo_median",
        "reward.function=even_last_digit",
        "actor.optim.lr=1e-3",
    ]

    def cli(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "rlstage.flows.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
        return proc.stdout

    trained = cli("train", *run)
    store = ArtifactStore(str(store_root))
    assert store.get_json("plugged", "run.json")["plugins"] == {"rlstage-testplugin": "0.1.0"}
    # the run's MLflow params name the plugin's loss and reward ("mlflow: sqlite:///<db> (experiment e, run <id>)")
    db, run_id = re.search(r"^mlflow: sqlite:///(\S+) \(experiment \S+, run (\w+)\)", trained, re.M).groups()
    with sqlite3.connect(db) as conn:
        params = dict(conn.execute("select key, value from params where run_uuid = ?", (run_id,)).fetchall())
    assert params["actor.policy_loss.name"] == "scaled_pg" and params["actor.policy_loss.scale"] == "4.0", params
    assert params["reward.function"] == "even_last_digit"
    update = store.manifest("plugged", 1, "update")
    assert update.meta["metrics"]["scaled_pg/scale"] == pytest.approx(4.0)  # the plugin's loss trained it
    rewarded = store.read_table(store.manifest("plugged", 1, "reward"), "rewards.parquet")
    assert set(rewarded.column("reward_fn").to_pylist()) == {"even_last_digit"}
    # the plugin's estimator computed the stored advantages: each score minus its group's median
    assert params["algorithm.adv_estimator"] == "grpo_median", params  # an estimator without settings: its name
    experience = store.read_table(store.manifest("plugged", 1, "advantage"), "experience.parquet").to_pylist()
    groups: dict = {}
    for row in experience:
        groups.setdefault(row["group_id"], []).append(row["score"])
    for row in experience:
        median = float(torch.tensor(groups[row["group_id"]]).median())
        assert row["advantages"][0] == pytest.approx(row["score"] - median, abs=1e-6), row["sample_id"]
    sft = store.manifest(kit_run_name(load_config(None, run)), None, "sft")
    from safetensors.torch import load

    assert weights_moved(
        load(store.read_bytes(sft, "model/model.safetensors")), update_weights(store, "plugged", 1)
    )
    replayed = cli("replay", "plugged", "1", "update", "--store", str(store_root))
    assert "output checksums equal the stored ones" in replayed, replayed

