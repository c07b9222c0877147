"""The tables the rollout, reward and eval stages commit, built from what the engines returned, with their metrics.

Pure functions, no I/O: the stage bodies (tasks/stages.py) generate and score, then hand the results here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rlstage.engines.agents.loop import AgentCompletion
from rlstage.engines.algorithms.advantages import overlong_penalty
from rlstage.engines.rewards.rules import RewardResult, combine_scores
from rlstage.engines.rollout.base import Completion
from rlstage.schemas import artifacts as A

_AGENT_COLUMNS = ("turn_bounds", "truncated", "num_turns", "tool_calls", "tool_errors", "tool_timeouts", "agent_reward", "turn_seconds")
REWARD_EXTRA = "reward_extra.parquet"  # a dict-returning reward's other keys, one column each (absent without any)


@dataclass
class Tables:
    """A stage's files and metrics."""

    tables: dict[str, pa.Table]
    metrics: dict[str, float] = field(default_factory=dict)


def rollouts(batch: list[dict], comps: Sequence[Completion], iteration: int, round_: int, per_round: int) -> Tables:
    """One generation round's rollouts table (prompts-table rows ``batch``, their completions) and its lengths."""
    # an extra round's samples and groups are told apart from the first round's (which may share a prompt)
    tag = f"{iteration}" if round_ == 0 else f"{iteration}.{round_}"
    cols: dict[str, list] = {name: [] for name in A.ROLLOUTS.names}
    for c in comps:
        agent = c if isinstance(c, AgentCompletion) else None  # a multi-turn rollout's columns; null otherwise
        p = batch[c.prompt_index]
        k = c.sample_index
        cols["sample_id"].append(f"{p['prompt_id']}/{tag}/{'greedy' if k < 0 else k}")
        cols["prompt_id"].append(p["prompt_id"])
        cols["group_id"].append(round_ * per_round + c.prompt_index)
        cols["sample_index"].append(c.sample_index)
        for k in ("prompt", "data_source", "ground_truth", "extra_info"):
            cols[k].append(p[k])
        cols["prompt_ids"].append(c.prompt_ids)
        cols["response_ids"].append(c.response_ids)
        cols["response_mask"].append((agent.response_mask if agent else None) or [1] * len(c.response_ids))
        cols["messages_json"].append(agent.messages_json if agent else None)
        for k in _AGENT_COLUMNS:
            cols[k].append(getattr(agent, k) if agent else None)
        status = agent.agent_status if agent else None
        cols["failure"].append(status if status not in (None, "ok") else None)
        cols["response_text"].append(c.text)
        cols["rollout_log_probs"].append(c.log_probs)
        cols["finish_reason"].append(c.finish_reason)
        cols["prompt_length"].append(len(c.prompt_ids))
        cols["response_length"].append(len(c.response_ids))
    table = pa.table(cols, schema=A.ROLLOUTS)
    lengths = np.array(table.column("response_length").to_pylist())
    prompt_lengths = np.array(table.column("prompt_length").to_pylist())
    clipped = np.array([f == "length" for f in table.column("finish_reason").to_pylist()])
    return Tables(
        {"rollouts.parquet": table},
        {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float(clipped.mean()),
            "prompt_length/mean": float(prompt_lengths.mean()),
            "rollout/tokens": float(lengths.sum() + prompt_lengths.sum()),
        },
    )


@dataclass(frozen=True)
class Overlong:
    """DAPO's overlong shaping: a soft punishment of responses within ``buffer_len`` of the longest one."""

    buffer_len: int
    penalty_factor: float
    max_response: int


def rewards(
    rollouts: pa.Table,
    given: list[float | None],
    ruled: dict[int, RewardResult],
    rm: list[RewardResult] | None = None,
    combine: str | None = None,
    overlong: Overlong | None = None,
) -> Tables:
    """The rewards table of a round's ``rollouts``: each row's rule result (``ruled``, by row), an agent function's own
    reward (``given``, None where it gave none) in its place, the reward model's score (``rm``) combined by ``combine``,
    then the overlong shaping; the score metrics count the sampled rows only (not ReMax's greedy baselines)."""
    n = rollouts.num_rows
    rule: list[float | None] = [None] * n
    fn_names: list[str | None] = [None] * n
    errors: list[str | None] = [None] * n
    extras: list[dict | None] = [None] * n
    for i, r in ruled.items():
        rule[i], fn_names[i], errors[i], extras[i] = r.score, r.reward_fn, r.error, r.metrics
    for i, g in enumerate(given):
        if g is not None:
            rule[i], fn_names[i], errors[i] = g, "agent.function", None
    rm_scores: list[float | None] = [None] * n
    combined: list = rule
    if rm is not None:
        rm_scores = [g.score for g in rm]
        for i, g in enumerate(rm):
            errors[i] = errors[i] or g.error
            fn_names[i] = g.reward_fn if fn_names[i] is None or combine == "replace" else f"{fn_names[i]}+{g.reward_fn}"
        combined = combine_scores(combine, rule, rm_scores)
    all_scores = np.array(combined, dtype=np.float64)
    shaping: dict[str, float] = {}
    if overlong is not None:
        lengths = [len(r) for r in rollouts.column("response_ids").to_pylist()]
        penalty = np.array(overlong_penalty(lengths, overlong.max_response, overlong.buffer_len, overlong.penalty_factor))
        all_scores = all_scores + penalty
        shaping = {"reward/overlong_penalty/mean": float(penalty.mean()), "reward/overlong_ratio": float((penalty < 0).mean())}
    real = np.array(rollouts.column("sample_index").to_pylist()) >= 0  # not ReMax baselines
    scores = all_scores[real]
    sources: dict[str, float] = {}
    if rm is not None:
        for key, vals in (("reward/rule/mean", rule), ("reward/rm/mean", rm_scores)):
            if got := [v for v, keep in zip(vals, real, strict=True) if keep and v is not None]:
                sources[key] = float(np.mean(got))
    table = pa.table(
        {
            "sample_id": rollouts.column("sample_id"),
            "score": pa.array(all_scores, pa.float32()),
            "reward_fn": fn_names,
            "error": errors,
            "failure": rollouts.column("failure") if "failure" in rollouts.column_names else pa.nulls(n, pa.string()),
            # also under overlong shaping: the rule score before it (dynamic sampling's acc metric)
            "score_rule": pa.array(rule if rm is not None or overlong is not None else [None] * n, pa.float32()),
            "score_rm": pa.array(rm_scores, pa.float32()),
        },
        schema=A.REWARDS,
    )
    extra_table, extra_metrics = _reward_extra(rollouts.column("sample_id"), extras, real)
    return Tables(
        {"rewards.parquet": table, **({REWARD_EXTRA: extra_table} if extra_table is not None else {})},
        {
            **extra_metrics,
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "reward/flat_group_share": flat_group_share(rollouts.column("group_id").to_numpy()[real], scores),
            "reward/errors": float(sum(e is not None for e in errors)),
            "reward/timeouts": float(sum(e is not None and e.startswith("timeout") for e in errors)),
            **sources,
            **shaping,
        },
    )


def flat_group_share(groups: np.ndarray, scores: np.ndarray) -> float:
    """The share of prompt groups whose samples all scored the same: a group-relative advantage is 0 in each."""
    ids, inverse = np.unique(groups, return_inverse=True)
    lo, hi = np.full(len(ids), np.inf), np.full(len(ids), -np.inf)
    np.minimum.at(lo, inverse, scores)
    np.maximum.at(hi, inverse, scores)
    return float((lo == hi).mean()) if len(ids) else 0.0


def _reward_extra(sample_ids: pa.ChunkedArray, extras: list[dict | None], real: np.ndarray) -> tuple[pa.Table | None, dict]:
    """verl's ``reward_extra_info``: each key a dict return carried beside its score, a column per key (null where a
    sample's return lacked it), and the mean of each numeric one over the real samples as ``reward/extra/<key>``."""
    keys = sorted({k for e in extras if e for k in e} - {"sample_id"})
    if not keys:
        return None, {}
    cols: dict[str, pa.Array] = {"sample_id": sample_ids}
    metrics: dict[str, float] = {}
    for k in keys:
        vals = [e.get(k) if e else None for e in extras]
        if all(v is None or isinstance(v, float) for v in vals):
            cols[k] = pa.array(vals, pa.float64())
            got = [v for v, keep in zip(vals, real, strict=True) if keep and v is not None]
            if got:
                metrics[f"reward/extra/{k}/mean"] = float(np.mean(got))
        else:
            cols[k] = pa.array([None if v is None else str(v) for v in vals], pa.string())
    return pa.table(cols), metrics


def eval_table(batch: list[dict], comps: Sequence[Completion], scores: list[float], greedy_n: int) -> pa.Table:
    """The eval stage's answers: the greedy ones first (sample_index -1), then the sampled ones, with their scores."""
    return pa.table(
        {
            "prompt_id": [batch[c.prompt_index]["prompt_id"] for c in comps],
            "sample_index": [-1] * greedy_n + [c.sample_index for c in comps[greedy_n:]],
            "response_text": [c.text for c in comps],
            "score": pa.array(scores, pa.float32()),
        },
        schema=A.EVAL,
    )
