"""docs/extending.md's config trains one iteration with all five example plugins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlstage.flows.checks import stored_config
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import ConfigError
from tests_support import EXAMPLES, PLUGINS, REPO, source_path, tiny_overrides


def test_the_pages_config_trains_an_iteration_with_all_five_plugins(prefect_api, migrated_home, tmp_path, examples):
    """The page's command, as written but for the tiny kit's short settings: one iteration trained with the
    plugins' estimator, loss, reward and data, recorded in run.json; the stored config names code to import, so
    a later command that does not name the plugins again is refused."""
    (tmp_path / "docs").symlink_to(REPO / "docs")  # the page runs from the repository root
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_HOME", "RLSTAGE_", "MLFLOW_"))}
    home = tmp_path / "home"
    migrated_home(home)
    env.update(PYTHONPATH=os.pathsep.join([str(EXAMPLES), source_path()]), RLSTAGE_HOME=str(home))
    store_root = tmp_path / "store"
    run = ["train", "-c", "docs/examples/extending/extended.yaml", *tiny_overrides(), "trainer.iterations=1"]
    run += [f"store.root={store_root}", "data.eval_size=8"]
    proc = subprocess.run(
        [sys.executable, "-m", "rlstage.flows.cli", *run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    store = ArtifactStore(str(store_root))
    assert sorted(store.get_json("extended", "run.json")["plugins"]) == sorted(PLUGINS)
    prep = store.manifest("extended", None, "data_prep")
    assert prep.meta["metrics"]["data/train_prompts"] == 200
    rewarded = store.read_table(store.manifest("extended", 1, "reward"), "rewards.parquet")
    assert set(rewarded.column("reward_fn").to_pylist()) == {"digit_match"}
    update = store.manifest("extended", 1, "update")
    assert "ppo_l2/penalty" in update.meta["metrics"]  # the plugin's loss trained it
    experience = store.read_table(store.manifest("extended", 1, "advantage"), "experience.parquet")
    advantages = [a for row in experience.column("advantages").to_pylist() for a in row]
    assert max(abs(a) for a in advantages) <= 2.0 + 1e-6  # the estimator's max_abs
    assert store.get_json("extended", "run.json")["config"]["rollout"]["engine"] == "plain_sampler"  # it sampled them
    with pytest.raises(ConfigError, match=r"plugins\.0: 'clipped_grpo' comes from the stored config"):
        stored_config(store, "extended")
    # named again, as the page's replay names them: loaded, and the same versions as the run recorded
    again = stored_config(store, "extended", [f"plugins=[{','.join(PLUGINS)}]"])
    assert again.reward.function == "digit_match" and again.data.source == "csv_qa"

