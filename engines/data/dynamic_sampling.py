"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``, ``recipe/dapo/dapo_ray_trainer.py``).

A group (the samples of one prompt) whose metric values are all equal has zero std, so a group-relative
advantage gives it no signal: it is dropped, and further prompts are generated ("gen batches") until the
kept groups fill the batch, which is then trimmed to exactly ``target`` groups, the first ones in
generation order. verl's conventions kept here: the std is numpy's population std (``np.std``); kept rows
stay in generation order, round after round (verl's ``DataProto.concat`` then ``batch[:traj_bsz]``);
``num_gen_batches`` counts every generation round including the first; reaching
``max_num_gen_batches`` rounds still short fails (verl raises). Departures: verl keeps a group of one
sample (and reads a cap of 0 as no cap); both are refused at config load here, since a one-sample group
carries no group signal and an unbounded loop cannot be resumed to a known end.

Pure functions over Arrow tables (a round's rollouts and rewards), no I/O: the stage task generates the
rounds and commits the selection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlstage.schemas.artifacts import GROUPS, REWARDS, ROLLOUTS, conform

__all__ = ["FILTER_METRICS", "DynamicSamplingExhausted", "GenRound", "Selection", "group_stats", "select_groups"]


def _rule_score(rewards: pa.Table) -> np.ndarray:
    """The reward function's score before overlong shaping and the reward model (``score_rule``), where
    the reward stage stored one; the sample's score otherwise (then nothing changed it)."""
    return pc.coalesce(rewards.column("score_rule"), rewards.column("score")).to_numpy(zero_copy_only=False)


def _seq_reward(rewards: pa.Table) -> np.ndarray:
    return rewards.column("score").to_numpy(zero_copy_only=False)


# verl's filter_groups.metric -> the per-sample value of a rewards table. verl's ``acc`` and ``score`` are
# the reward function's output before overlong shaping; ``seq_reward`` the shaped score (token_level_scores
# summed); ``seq_final_reward`` adds the KL-in-reward penalty, which rlstage applies after the filter (in the
# advantage stage): config load refuses it with algorithm.use_kl_in_reward, so it equals seq_reward here.
FILTER_METRICS: dict[str, Callable[[pa.Table], np.ndarray]] = {
    "acc": _rule_score,
    "score": _rule_score,
    "seq_reward": _seq_reward,
    "seq_final_reward": _seq_reward,
}


class DynamicSamplingExhausted(RuntimeError):
    """The generation-round cap was reached with fewer groups with signal than the batch needs."""


@dataclass(frozen=True)
class GenRound:
    """One generation round: its rollouts and their rewards, row for row."""

    rollouts: pa.Table
    rewards: pa.Table


@dataclass(frozen=True)
class GroupStat:
    round: int
    group_id: int
    prompt_id: str
    samples: int
    mean: float
    std: float

    @property
    def has_signal(self) -> bool:
        return self.std > 0



def group_stats(gen: GenRound, metric: str, round_: int) -> list[GroupStat]:
    """Per group of one round (first-appearance order): its samples' metric mean and population std.
    ReMax's greedy baseline rows (sample_index -1) are not samples of the group."""
    if gen.rollouts.column("sample_id").to_pylist() != gen.rewards.column("sample_id").to_pylist():
        raise ValueError("rewards do not line up with rollouts (sample_id order differs)")
    values = FILTER_METRICS[metric](gen.rewards).astype(np.float64)
    groups = gen.rollouts.column("group_id").to_pylist()
    prompts = gen.rollouts.column("prompt_id").to_pylist()
    real = np.asarray(gen.rollouts.column("sample_index").to_pylist()) >= 0
    by_group: dict[int, list[float]] = {}
    prompt_of: dict[int, str] = {}
    for g, p, v, is_sample in zip(groups, prompts, values, real, strict=True):
        prompt_of.setdefault(g, p)
        if is_sample:
            by_group.setdefault(g, []).append(float(v))
    return [
        GroupStat(round_, g, prompt_of[g], len(v), float(np.mean(v)), float(np.std(v))) for g, v in by_group.items()
    ]


@dataclass(frozen=True)
class Selection:
    """What dynamic sampling generated and kept: the trained batch and every group's verdict."""

    rollouts: pa.Table  # the first `target` groups with signal, rows in generation order
    rewards: pa.Table
    groups: pa.Table  # GROUPS: every generated group
    rounds: list[GenRound]  # every round as generated (the first is the rollout/reward stages' own)

    @property
    def num_gen_batches(self) -> int:
        return len(self.rounds)

    def metrics(self) -> dict[str, float]:
        """verl's ``train/num_gen_batches``, the dropped share of generated groups, and the score statistics of
        the trained batch (verl computes its data metrics after the filter: these stand in for the reward stage's)."""
        signal = self.groups.column("has_signal").to_numpy(zero_copy_only=False)
        real = np.asarray(self.rollouts.column("sample_index").to_pylist()) >= 0
        scores = self.rewards.column("score").to_numpy(zero_copy_only=False)[real]
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/filter_groups/generated_groups": float(len(signal)),
            "train/filter_groups/kept_groups": float(signal.sum()),
            "train/filter_groups/dropped_share": float(1 - signal.mean()),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
        }


def select_groups(
    first: GenRound, generate: Callable[[int], GenRound], target: int, max_rounds: int, metric: str
) -> Selection:
    """Keep the groups with signal of ``first``, calling ``generate(round)`` for rounds 1, 2, ... while fewer
    than ``target`` are kept; trims to the first ``target``. Raises ``DynamicSamplingExhausted`` when
    ``max_rounds`` rounds (the first included) leave it short."""
    if max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds}: dynamic sampling needs at least one generation round")
    rounds = [first]
    stats = group_stats(first, metric, 0)
    while sum(s.has_signal for s in stats) < target:
        if len(rounds) >= max_rounds:
            kept = sum(s.has_signal for s in stats)
            raise DynamicSamplingExhausted(
                f"dynamic sampling kept {kept} of the {target} groups with signal a batch needs after "
                f"algorithm.filter_groups.max_num_gen_batches={max_rounds} generation rounds ({len(stats)} groups "
                f"generated, metric {metric}): raise the cap, or the data is too easy or too hard for the policy"
            )
        rounds.append(generate(len(rounds)))
        stats += group_stats(rounds[-1], metric, len(rounds) - 1)
    chosen = {(s.round, s.group_id) for s in [s for s in stats if s.has_signal][:target]}
    rollouts, rewards = [], []
    for r, gen in enumerate(rounds):
        keep = pa.array([(r, g) in chosen for g in gen.rollouts.column("group_id").to_pylist()], pa.bool_())
        # read back from Parquet or built in memory: one schema for the concatenation
        rollouts.append(conform(gen.rollouts.filter(keep), ROLLOUTS))
        rewards.append(conform(gen.rewards.filter(keep), REWARDS))
    groups = pa.table(
        {
            "round": [s.round for s in stats],
            "group_id": [s.group_id for s in stats],
            "prompt_id": [s.prompt_id for s in stats],
            "samples": [s.samples for s in stats],
            "metric_mean": [s.mean for s in stats],
            "metric_std": [s.std for s in stats],
            "has_signal": [s.has_signal for s in stats],
            "in_batch": [(s.round, s.group_id) in chosen for s in stats],
        },
        schema=GROUPS,
    )
    return Selection(pa.concat_tables(rollouts), pa.concat_tables(rewards), groups, rounds)
