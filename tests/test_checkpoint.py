"""Checkpoint every k updates, resume in between: the same losses and artifacts as an uninterrupted run."""

from __future__ import annotations

import pytest

from schemas.config import ConfigError, load_config
from tests_support import tiny_overrides

pytestmark = pytest.mark.slow
STAGES = ("rollout", "reward", "advantage", "update", "eval")


def _cfg(root, iterations: int):
    # An entropy bonus moves the weights even when the tiny model earns no reward yet.
    overrides = [f"store.root={root}", "run_name=ck", "trainer.checkpoint_every=2", "actor.entropy_coeff=0.01"]
    return load_config(None, [*tiny_overrides(), *overrides, f"trainer.iterations={iterations}"])


def _checksums(store, iterations: int) -> dict[str, str]:
    return {
        f"{it}/{stage}/{name}": entry.sha256
        for it in range(1, iterations + 1)
        for stage in STAGES
        for name, entry in store.manifest("ck", it, stage).files.items()
    }


def test_resume_between_checkpoints_matches_an_uninterrupted_run(prefect_api, tmp_path):
    from flows.replay import replay
    from flows.training import train
    from tasks.runtime import store_for

    reference = train(config=_cfg(tmp_path / "ref", 2))
    # Stopped after iteration 1, between checkpoints: the policy worker dies with the flow.
    train(config=_cfg(tmp_path / "res", 1))
    store = store_for(_cfg(tmp_path / "res", 2))
    first = store.manifest("ck", 1, "update")
    assert first.meta["between_checkpoints"] and "trainer_state/trainer_state.json" not in first.files
    resumed = train(config=_cfg(tmp_path / "res", 2))
    # iteration 2 rebuilt the policy of iteration 1 from its stored experience, not by rerunning the stage
    assert "iter-1/update" not in resumed["executed"] and "iter-2/rollout" in resumed["executed"]
    assert _checksums(store, 2) == _checksums(store_for(_cfg(tmp_path / "ref", 2)), 2)
    losses = [h.get("actor/pg_loss") for h in resumed["history"] if h["iteration"] > 1]
    assert losses == [h.get("actor/pg_loss") for h in reference["history"] if h["iteration"] > 1]
    assert all(h["actor/grad_norm"] > 0 for h in resumed["history"] if h["iteration"] > 1)  # the policy moved
    assert "trainer_state/trainer_state.json" in store.manifest("ck", 2, "update").files  # the k-th update is a checkpoint

    # A replay of iteration 2's rollout needs the policy of iteration 1: rebuilt, same checksums.
    assert replay(run_name="ck", iteration=2, stage="rollout", store_root=str(tmp_path / "res"))["identical"]
    # Rebuilding it under other actor settings would be another policy: refused.
    with pytest.raises(ConfigError, match="between checkpoints"):
        replay(run_name="ck", iteration=2, stage="update", store_root=str(tmp_path / "res"), overrides=["actor.optim.lr=0.01"])
