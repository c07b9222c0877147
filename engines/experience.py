"""The experience of an iteration: rollouts and rewards lined up, outcome rewards placed on tokens, KL in the
reward, the advantage estimator, and the metrics and guards verl's driver computes around them.

The advantage stage (tasks/stages.py) reads its inputs, asks the workers for the forwards (old, reference
log-probs, values), calls ``compute_experience`` and commits its table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.training.forward import pad_right
from rlstage.schemas import artifacts as A
from rlstage.schemas.config import AdvEstimatorConfig

BYPASS_CHECK_ROWS = 8  # rows whose old log-probs are still recomputed under bypass, for the gap guard


def unpad(t: torch.Tensor, lens: list[int]) -> list[list[float]]:
    return [t[i, :n].tolist() for i, n in enumerate(lens)]


@dataclass
class Samples:
    """A rollout's sampled rows lined up with their rewards; ReMax's greedy rows become per-group baselines."""

    rollouts: pa.Table  # the sampled rows (sample_index >= 0)
    scores: torch.Tensor  # [rows] outcome reward
    index: np.ndarray  # [rows] group id
    baseline: dict[int, float]  # group id -> the greedy answer's score (ReMax), empty otherwise

    def column(self, name: str) -> list:
        return self.rollouts.column(name).to_pylist()


def line_up(rollouts: pa.Table, rewards: pa.Table) -> Samples:
    if rollouts.column("sample_id").to_pylist() != rewards.column("sample_id").to_pylist():
        raise ValueError("rewards do not line up with rollouts (sample_id order differs)")
    all_scores = np.array(rewards.column("score").to_pylist(), dtype=np.float32)
    is_sample = np.array(rollouts.column("sample_index").to_pylist()) >= 0
    groups = np.array(rollouts.column("group_id").to_pylist())
    baseline = dict(zip(groups[~is_sample].tolist(), all_scores[~is_sample].tolist(), strict=True))
    index = groups[is_sample].copy()
    failed = [f is not None for f, keep in zip(_failures(rollouts), is_sample, strict=True) if keep]
    # A failed sample (an agent that timed out, raised, ...) is left out of its group's baseline: it becomes a group
    # of its own (no other sample's advantage depends on its 0), and its tokens are masked out of the loss already.
    for j, i in enumerate(np.flatnonzero(failed)):
        index[i] = -(j + 1)  # group ids of real groups are >= 0
    return Samples(rollouts.filter(pa.array(is_sample)), torch.from_numpy(all_scores[is_sample]), index, baseline)


def _failures(rollouts: pa.Table) -> list:
    return rollouts.column("failure").to_pylist() if "failure" in rollouts.column_names else [None] * rollouts.num_rows


def bypass_rows(rows: int) -> list[int]:
    """verl's bypass takes the rollout's log-probs as the old ones; these rows are still recomputed, so that a
    stale weight sync fails the gap guard."""
    return list(range(0, rows, max(1, rows // BYPASS_CHECK_ROWS)))


@dataclass
class Forwards:
    """What the workers computed on the samples' tokens."""

    old_log_probs: list[list[float]]
    checked: list[int]  # rows whose old log-probs the trainer recomputed (all but under bypass)
    sum_pi_squared: list[list[float]] | None = None
    ref_log_probs: list[list[float]] | None = None
    values: list[list[float]] | None = None


@dataclass
class Experience:
    table: pa.Table  # schemas.artifacts.EXPERIENCE
    metrics: dict[str, float]
    kl_state: dict | None  # the adaptive KL controller's state, carried to the next iteration


def needs_sum_pi_squared(estimator: AdvEstimatorConfig) -> bool:
    """Whether the estimator declares that it needs the old policy's sum of pi^2 per token."""
    return "sum_pi_squared" in algos.ADV_ESTIMATORS.entry(estimator.name).needs


def otb_is_weights(algorithm, old: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """The rollout-correction IS weights that the optimal token baseline folds in (as verl's driver computes them
    before the advantage, decoupled mode only); None for every other estimator."""
    rc = algorithm.rollout_correction
    if not needs_sum_pi_squared(algorithm.adv_estimator) or rc.rollout_is is None or rc.bypass_mode:
        return None
    weights, _ = algos.rollout_correction(
        old,
        rollout_lp,
        mask,
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
    )
    return weights


def compute_experience(
    samples: Samples,
    fwd: Forwards,
    algorithm,
    *,
    kl_state: dict | None,
    off_policy: bool,
    max_logprob_gap: float | None,
    engine: str,
    iteration: int,
) -> Experience:
    """Token rewards (the outcome on each response's last policy token, minus the KL penalty when
    ``algorithm.use_kl_in_reward``), advantages and returns, the experience table and its metrics.

    ``algorithm`` is the run's ``algorithm`` settings; ``kl_state`` the previous iteration's KL controller.
    Raises when an on-policy rollout's log-probs differ from the trainer's recompute by more than
    ``max_logprob_gap`` (a missed or broken weight sync), before anything trains on them.
    """
    a = algorithm
    response_ids = samples.column("response_ids")
    masks = samples.column("response_mask")
    rollout_lp = samples.column("rollout_log_probs")
    lens = [len(r) for r in response_ids]
    width = max(lens)
    pad = functools.partial(pad_right, value=0.0, dtype=torch.float32, width=width)
    mask = pad(masks)
    old, checked, ref_lp, values = fwd.old_log_probs, fwd.checked, fwd.ref_log_probs, fwd.values
    old_t, roll_lp = pad(old), pad(rollout_lp)
    ref_t = None if ref_lp is None else pad(ref_lp)
    values_t = None if values is None else pad(values)
    metrics: dict[str, float] = {}
    # Outcome reward sits on the last policy token of each response.
    token_scores = torch.zeros_like(mask)
    for i, m in enumerate(masks):
        last = max((j for j, v in enumerate(m) if v), default=None)
        if last is not None:
            token_scores[i, last] = samples.scores[i]
    token_rewards = token_scores
    new_kl_state = None
    if a.use_kl_in_reward:
        ctrl = algos.get_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
        if kl_state is not None:
            ctrl.load_state_dict(kl_state)  # beta carries over between iterations
        token_rewards, kl_metrics = algos.apply_kl_penalty(token_scores, old_t, ref_t, mask, ctrl, a.kl_penalty)
        metrics.update(kl_metrics)
        new_kl_state = ctrl.state_dict()
    baseline = samples.baseline
    adv, ret = algos.compute_advantage(
        a.adv_estimator.name,
        token_level_rewards=token_rewards,
        response_mask=mask,
        index=samples.index,
        values=values_t,
        reward_baselines=torch.tensor([baseline.get(g, 0.0) for g in samples.index.tolist()], dtype=torch.float32)
        if baseline
        else None,
        gamma=a.gamma,
        lam=a.lam,
        norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
        old_log_probs=old_t,
        sum_pi_squared=None if fwd.sum_pi_squared is None else pad(fwd.sum_pi_squared),
        rollout_is_weights=otb_is_weights(a, old_t, roll_lp, mask),
        settings=algos.adv_estimator_settings(a.adv_estimator),
    )
    list_type = A.EXPERIENCE.field("ref_log_probs").type
    ro = samples.rollouts
    table = pa.table(
        {
            "sample_id": ro.column("sample_id"),
            "group_id": ro.column("group_id"),
            "prompt_ids": ro.column("prompt_ids"),
            "response_ids": ro.column("response_ids"),
            "response_mask": ro.column("response_mask"),
            "score": pa.array(samples.scores.numpy(), pa.float32()),
            "old_log_probs": old,
            "ref_log_probs": pa.nulls(len(lens), list_type) if ref_lp is None else ref_lp,
            "values": pa.nulls(len(lens), list_type) if values is None else values,
            "token_level_rewards": unpad(token_rewards, lens),
            "advantages": unpad(adv, lens),
            "returns": unpad(ret, lens),
            "rollout_log_probs": ro.column("rollout_log_probs"),
        },
        schema=A.EXPERIENCE,
    )
    valid = mask.bool()
    metrics.update(
        {
            "critic/advantages/mean": float(algos.masked_mean(adv, mask)),
            "critic/advantages/max": float(adv[valid].max()) if valid.any() else 0.0,
            "critic/advantages/min": float(adv[valid].min()) if valid.any() else 0.0,
            "critic/returns/mean": float(algos.masked_mean(ret, mask)),
            "critic/rewards/mean": float(token_rewards.sum(-1).mean()),
            "rollout/logprob_gap": float(algos.masked_mean((roll_lp - old_t)[checked].abs(), mask[checked])),
            # Pipelined iterations: the rollout sampled with an older policy than the one being trained.
            "rollout/off_policy": float(off_policy),
        }
    )
    # On-policy, the rollout engine should hold the trainer's weights; a gap means a missed or broken
    # weight sync: fail before anything trains on it. Off-policy the gap is expected (rollout_corr weights).
    gap = metrics["rollout/logprob_gap"]
    if max_logprob_gap is not None and not gap <= max_logprob_gap and not off_policy:
        raise RuntimeError(
            f"iteration {iteration}: rollout/logprob_gap {gap:.3g} > rollout.max_logprob_gap {max_logprob_gap:g}: the "
            f"{engine} rollout engine's log-probs differ from the trainer's recompute on the same tokens"
        )
    if ref_lp is not None:
        metrics["actor/ref_kl"] = float(algos.masked_mean(old_t - ref_t, mask))
    if values is not None:
        metrics["critic/values/mean"] = float(algos.masked_mean(values_t, mask))
    if baseline:
        metrics["critic/baseline/mean"] = float(np.mean(list(baseline.values())))
    return Experience(table, metrics, new_kl_state)
