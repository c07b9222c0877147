"""Every estimator config runs through the pipeline: the reference policy, KL in the reward,
the critic (values, its own update stage, warm-up) and ReMax's greedy baseline flow through."""

from __future__ import annotations

import pytest

from rlstage.schemas.config import load_config
from tests_support import REPO, tiny_overrides

CONFIGS = REPO / "configs"


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    """One store for every config's run (each named after its config): the tiny kit's SFT is trained once."""
    return tmp_path_factory.mktemp("estimators")


@pytest.mark.parametrize(
    "name", ["dr_grpo", "rloo", "reinforce_plus_plus", "remax", "ppo_gae", "gspo", "sapo", "gmpo", "dapo", "rollout_corr"]
)
def test_estimator_config_runs(prefect_api, shared_root, name):
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    overrides = [f"store.root={shared_root}", *tiny_overrides()]
    if name == "ppo_gae":
        overrides += ["critic.ppo_mini_batch_size=16", "critic.micro_batch_size=8"]
    if name == "dapo":  # the tiny kit's rule rewards are all 0: only the overlong shaping tells samples apart
        overrides += ["algorithm.filter_groups.metric=seq_reward"]
    cfg = load_config(CONFIGS / f"{name}.yaml", overrides)
    result = train(config=cfg)
    store = store_for(cfg)
    exp = store.read_table(store.manifest(name, 2, "advantage"), "experience.parquet")
    assert exp.num_rows == 8 * 4  # ReMax's greedy baselines are not trained on
    assert (exp.column("ref_log_probs").null_count == 0) == cfg.needs_ref
    assert (exp.column("values").null_count == 0) == cfg.critic.enable
    hist = {h["iteration"]: h for h in result["history"]}
    if name == "reinforce_plus_plus":
        assert hist[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
        assert "actor/ref_kl" in hist[2]
    if name == "remax":
        assert "critic/baseline/mean" in hist[1]
        rollouts = store.read_table(store.manifest(name, 1, "rollout"), "rollouts.parquet")
        assert rollouts.num_rows == 8 * 4 + 8
    if name == "rollout_corr":  # token TIS weights from the stored rollout log-probs
        assert exp.column("rollout_log_probs").null_count == 0
        assert 0.9 < hist[2]["rollout_corr/rollout_is_mean"] <= 2.0
        assert "rollout_corr/k3_kl" in hist[2]
    if name == "dapo":
        assert 0.0 <= hist[1]["reward/overlong_ratio"] <= 1.0
        assert hist[2]["train/num_gen_batches"] >= 1 and store.manifest(name, 2, "filter_groups") is not None
    if name == "ppo_gae":
        assert hist[1]["actor/skipped"] == 1.0  # critic warm-up: the actor waits one iteration
        assert "actor/pg_loss" in hist[2]
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean"):
            assert key in hist[2], key
        assert store.manifest(name, 2, "critic").inputs["critic"] == store.manifest(name, 1, "critic").artifact_id
        # the critic's first input is the initial policy with a fresh value head
        assert store.manifest(name, 1, "critic").inputs["critic"].startswith("critic-init:")
