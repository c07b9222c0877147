"""Arrow schemas of every stage's artifact: the contracts stages talk through.

Per-token columns are lists aligned with ``response_ids`` (one entry per response token).
``response_mask`` is 1 on tokens the policy generated and 0 elsewhere (tool output, template
tokens in multi-turn trajectories); every estimator and loss consumes it unchanged.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

_tokens = pa.list_(pa.int32())
_floats = pa.list_(pa.float32())
_mask = pa.list_(pa.int8())
_messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_turns = pa.list_(pa.struct([("role", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))

PROMPTS = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),  # text fed to the tokenizer (chat messages rendered)
        ("messages", _messages),  # chat form, null for plain-text prompts
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        ("extra_info", pa.string()),  # JSON object
    ]
)

ROLLOUTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("prompt_id", pa.string()),
        ("group_id", pa.int64()),  # samples of one prompt share a group
        ("sample_index", pa.int32()),
        ("prompt", pa.string()),
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        ("extra_info", pa.string()),
        ("prompt_ids", _tokens),
        ("response_ids", _tokens),
        ("response_mask", _mask),
        ("response_text", pa.string()),
        ("rollout_log_probs", _floats),  # sampling log-probs of the response tokens
        ("finish_reason", pa.string()),  # "stop" | "length"
        ("prompt_length", pa.int32()),
        ("response_length", pa.int32()),
        # Multi-turn tool-calling rollouts (agent.enable); null on single-turn rollouts.
        ("messages_json", pa.string()),  # the whole conversation, a JSON list of {role, content[, name]}
        ("turn_bounds", _turns),  # [start, end) of each assistant / tool turn in response_ids
        ("truncated", pa.bool_()),  # stopped by agent.max_response_tokens at a turn boundary
        ("num_turns", pa.int32()),  # assistant turns
        ("tool_calls", pa.int32()),
        ("tool_errors", pa.int32()),  # malformed, unknown tool, bad arguments, raised, timed out, over the limit
        ("tool_timeouts", pa.int32()),
        # agent.function runs: the reward the agent returned (null: the rule scores response_text; 0 when it failed)
        ("agent_reward", pa.float32()),
        # wall seconds of each turn of turn_bounds: the policy's generation, or the tools' (the agent's own) work
        ("turn_seconds", _floats),
        # agent.function runs: how a failed sample failed (timeout, raised, bad_return, no_request, too_long); null: ok
        ("failure", pa.string()),
    ]
)

REWARDS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("score", pa.float32()),
        ("reward_fn", pa.string()),
        ("error", pa.string()),  # null unless the reward function raised or timed out
        # null where the sample's source has no rule, or neither a reward model nor overlong shaping is on
        ("score_rule", pa.float32()),
        ("score_rm", pa.float32()),  # null unless reward_model.enable
        ("failure", pa.string()),  # the rollout's failed sample kind (agent.function), null when it did not fail
    ]
)

EXPERIENCE = pa.schema(
    [
        ("sample_id", pa.string()),
        ("group_id", pa.int64()),
        ("prompt_ids", _tokens),
        ("response_ids", _tokens),
        ("response_mask", _mask),
        ("score", pa.float32()),
        ("old_log_probs", _floats),  # recomputed by the trainer, not the sampler
        ("ref_log_probs", _floats),  # null without a reference policy
        ("values", _floats),  # null without a critic
        ("token_level_rewards", _floats),
        ("advantages", _floats),
        ("returns", _floats),
        ("rollout_log_probs", _floats),  # the sampler's (rollout correction, bypass mode); null in older runs
    ]
)

# Dynamic sampling (engines/data/dynamic_sampling.py): every generated group and what the filter decided.
GROUPS = pa.schema(
    [
        ("round", pa.int32()),
        ("group_id", pa.int64()),
        ("prompt_id", pa.string()),
        ("samples", pa.int32()),
        ("metric_mean", pa.float64()),
        ("metric_std", pa.float64()),
        ("has_signal", pa.bool_()),  # metric std > 0: kept by the filter
        ("in_batch", pa.bool_()),  # among the first `target` kept groups: trained on
    ]
)

EVAL = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample_index", pa.int32()),  # -1 for the greedy sample
        ("response_text", pa.string()),
        ("score", pa.float32()),
    ]
)

METRICS = pa.schema([("name", pa.string()), ("value", pa.float64())])

SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "rollouts": ROLLOUTS,
    "rewards": REWARDS,
    "experience": EXPERIENCE,
    "eval": EVAL,
    "metrics": METRICS,
}


# Columns added after an artifact kind was first stored: a table written before them gets them as nulls.
LATE_COLUMNS = frozenset({"agent_reward", "turn_seconds", "failure"})
# Columns of wall-clock time: a replay that reproduces every other value is the same artifact (flows/replay.py).
TIMING_COLUMNS = frozenset({"turn_seconds"})


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Cast ``table`` to ``schema`` (column order and types), failing on missing columns (but ``LATE_COLUMNS``)."""
    for f in schema:
        if f.name in LATE_COLUMNS and f.name not in table.column_names:
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"artifact is missing columns {missing}")
    return table.select(schema.names).cast(schema)


def metrics_table(metrics: dict[str, float]) -> pa.Table:
    names = sorted(metrics)
    return pa.table({"name": names, "value": [float(metrics[n]) for n in names]}, schema=METRICS)


def metrics_from_table(table: pa.Table) -> dict[str, float]:
    return dict(zip(table.column("name").to_pylist(), table.column("value").to_pylist(), strict=True))
