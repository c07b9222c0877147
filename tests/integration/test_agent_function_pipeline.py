"""agent.function end to end (issue 40 item 3): the calculator task as a plain OpenAI-client agent trains, with
the weights moving, to exactly what the built-in loop trains to with the same seed."""

from __future__ import annotations

import json

import pytest

from rlstage.schemas.config import load_config
from tests_support import (
    agent_overrides,
    moving_overrides,
    stage_rows,
    tiny_overrides,
    update_weights,
    weights_moved,
)

AGENT = [
    *agent_overrides(),
    # Every request joins its batch however slow HTTP is here: the batches (and their seeds) are the same in both runs.
    "agent.batch_window_ms=20000",
]
EQUAL = ["rollout.max_new_tokens=96"]  # room for a whole call (81 characters) in a turn: calls that run, answers that score
FUNCTION = "agent.function=rlstage.engines.agents.examples:calculator_agent"


@pytest.fixture(scope="module")
def runs(prefect_api, tmp_path_factory):
    from rlstage.flows.training import train

    store = tmp_path_factory.mktemp("agent-function") / "store"
    out = {}
    for name, extra in (("builtin", []), ("function", [FUNCTION])):
        cfg = load_config(None, [f"store.root={store}", f"run_name={name}", *tiny_overrides(), *moving_overrides(), *AGENT, *EQUAL, *extra])
        out[name] = (cfg, train(config=cfg))
    return out


def test_the_openai_client_agent_trains_to_the_built_in_loops_tokens_rewards_and_weights(runs):
    from rlstage.tasks.runtime import store_for

    cfg, _ = runs["function"]
    store = store_for(cfg)
    same = ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "messages_json", "turn_bounds", "finish_reason", "num_turns", "tool_calls", "tool_errors")
    multi_turn = 0
    for it in (1, 2):
        built = stage_rows(cfg, "builtin", it, "rollout", "rollouts.parquet")
        fn = stage_rows(cfg, "function", it, "rollout", "rollouts.parquet")
        assert len(fn) == len(built) == 32
        assert [{k: r[k] for k in same} for r in fn] == [{k: r[k] for k in same} for r in built]
        assert all(r["agent_reward"] is None for r in fn)  # the agent returns None: the rule scores its answer
        multi_turn += sum(r["num_turns"] > 1 and 0 in r["response_mask"] for r in fn)
        scores = [[r["score"] for r in stage_rows(cfg, run, it, "reward", "rewards.parquet")] for run in ("builtin", "function")]
        assert scores[0] == scores[1]
    assert multi_turn > 0  # the SFT'd policy calls the calculator: masked tool turns are compared too
    w = {run: [update_weights(store, run, it) for it in (1, 2)] for run in ("builtin", "function")}
    assert weights_moved(w["function"][0], w["function"][1])
    for a, b in zip(w["builtin"], w["function"], strict=True):
        assert not weights_moved(a, b)


def test_the_agent_function_runs_are_counted_by_status(runs):
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for

    cfg, result = runs["function"]
    metrics = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"]).data.metrics
    assert metrics["agent/status/ok"] == 32 and "agent/status/raised" not in metrics
    msgs = json.loads(stage_rows(cfg, "function", 1, "rollout", "rollouts.parquet")[0]["messages_json"])
    assert msgs[0]["role"] == "user"
