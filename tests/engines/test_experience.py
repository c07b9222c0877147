"""engines/experience.py: the advantage stage's math without workers, Prefect or a store."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.experience import Forwards, bypass_rows, compute_experience, line_up
from rlstage.schemas import artifacts as A
from rlstage.schemas.config import load_config

COLS = ("sample_id", "group_id", "sample_index", "prompt_ids", "response_ids", "response_mask", "rollout_log_probs")


def _tables(scores: list[float], groups: list[int], indices: list[int], masks: list[list[int]]):
    n = len(scores)
    data = {
        "sample_id": [f"s{i}" for i in range(n)],
        "group_id": groups,
        "sample_index": indices,
        "prompt_ids": [[1, 2]] * n,
        "response_ids": [[5] * len(m) for m in masks],
        "response_mask": masks,
        "rollout_log_probs": [[-0.5] * len(m) for m in masks],
    }
    rollouts = pa.table({c: pa.array(data[c], A.ROLLOUTS.field(c).type) for c in COLS})
    rewards = pa.table({"sample_id": data["sample_id"], "score": pa.array(scores, pa.float32())})
    return rollouts, rewards


def _algorithm(*overrides: str):
    return load_config(None, list(overrides)).algorithm


def test_grpo_experience_places_the_outcome_on_the_last_policy_token():
    masks = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    samples = line_up(*_tables([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [0, 1, 0, 1], masks))
    old = [[-0.5] * len(m) for m in masks]
    exp = compute_experience(samples, Forwards(old, list(range(4))), _algorithm(), kl_state=None, off_policy=False, max_logprob_gap=1e-3, engine="hf", iteration=1)
    rewards = exp.table.column("token_level_rewards").to_pylist()
    assert rewards == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    width = 3
    mask = torch.tensor(masks, dtype=torch.float32)
    want, _ = algos.compute_advantage("grpo", token_level_rewards=torch.tensor(rewards), response_mask=mask, index=samples.index)
    got = exp.table.column("advantages").to_pylist()
    for i, m in enumerate(masks):
        assert got[i] == pytest.approx(want[i, : len(m)].tolist()) and len(got[i]) <= width
    assert exp.metrics["rollout/logprob_gap"] == 0.0 and exp.metrics["rollout/off_policy"] == 0.0
    assert exp.table.schema == A.EXPERIENCE and exp.kl_state is None


def test_greedy_rows_become_remax_baselines_and_misaligned_rewards_fail():
    masks = [[1], [1], [1], [1]]
    rollouts, rewards = _tables([1.0, 0.0, 0.5, 1.0], [0, 0, 0, 1], [0, 1, -1, -1], masks)
    samples = line_up(rollouts, rewards)
    assert samples.rollouts.num_rows == 2 and samples.baseline == {0: 0.5, 1: 1.0}
    with pytest.raises(ValueError, match="do not line up"):
        line_up(rollouts, rewards.take([1, 0, 2, 3]))


def test_the_gap_guard_fails_on_policy_and_not_off_policy():
    masks = [[1, 1], [1, 1]]
    samples = line_up(*_tables([1.0, 0.0], [0, 0], [0, 1], masks))
    far = Forwards([[-1.5, -1.5], [-1.5, -1.5]], [0, 1])  # the rollout said -0.5
    kw = dict(kl_state=None, max_logprob_gap=1e-3, engine="vllm", iteration=3)
    with pytest.raises(RuntimeError, match=r"iteration 3: rollout/logprob_gap 1 > rollout.max_logprob_gap 0.001: the vllm"):
        compute_experience(samples, far, _algorithm(), off_policy=False, **kw)
    exp = compute_experience(samples, far, _algorithm(), off_policy=True, **kw)
    assert exp.metrics["rollout/logprob_gap"] == pytest.approx(1.0)
    assert bypass_rows(64) == list(range(0, 64, 8)) and bypass_rows(3) == [0, 1, 2]


def test_kl_in_reward_carries_the_adaptive_controller():
    masks = [[1, 1], [1, 1]]
    samples = line_up(*_tables([1.0, 0.0], [0, 0], [0, 1], masks))
    algorithm = _algorithm("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")
    fwd = Forwards([[-0.5, -0.5], [-0.5, -0.5]], [0, 1], ref_log_probs=[[-0.7, -0.7], [-0.7, -0.7]])
    kw = dict(off_policy=False, max_logprob_gap=None, engine="hf", iteration=2)
    first = compute_experience(samples, fwd, algorithm, kl_state=None, **kw)
    second = compute_experience(samples, fwd, algorithm, kl_state=first.kl_state, **kw)
    assert first.kl_state is not None and second.kl_state != first.kl_state  # beta moved, and carried over
    assert first.table.column("token_level_rewards").to_pylist()[0][0] < 0  # the penalty on a non-final token
    assert "actor/ref_kl" in first.metrics
