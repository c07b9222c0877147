"""Agent mode end to end: two iterations of multi-turn tool-calling rollouts through the pipeline."""

from __future__ import annotations

import json

import pytest

from rlstage.schemas.config import load_config
from tests_support import agent_overrides, tiny_overrides

AGENT = agent_overrides()


@pytest.fixture(scope="module")
def agent_run(prefect_api, tmp_path_factory):
    from rlstage.flows.training import train

    tmp = tmp_path_factory.mktemp("agent-pipeline")
    cfg = load_config(None, [f"store.root={tmp / 'store'}", "run_name=agent", *tiny_overrides(), *AGENT])
    return cfg, train(config=cfg)


def test_rollouts_carry_the_trajectory_masks_and_turns(agent_run):
    from rlstage.tasks.runtime import store_for

    cfg, result = agent_run
    store = store_for(cfg)
    for it in (1, 2):
        for stage in ("rollout", "reward", "advantage", "update", "eval"):
            assert store.manifest("agent", it, stage) is not None, f"iter {it} {stage} not committed"
        rows = store.read_table(store.manifest("agent", it, "rollout"), "rollouts.parquet").to_pylist()
        assert len(rows) == 8 * 4
        for r in rows:
            n = len(r["response_ids"])
            assert len(r["response_mask"]) == n == len(r["rollout_log_probs"]) == r["response_length"]
            # Turns tile the response; assistant turns are exactly the mask's 1s.
            bounds = r["turn_bounds"]
            assert bounds[0]["start"] == 0 and bounds[-1]["end"] == n
            assert all(a["end"] == b["start"] for a, b in zip(bounds, bounds[1:], strict=False))
            for b in bounds:
                want = 1 if b["role"] == "assistant" else 0
                assert r["response_mask"][b["start"] : b["end"]] == [want] * (b["end"] - b["start"])
            assert r["num_turns"] == sum(b["role"] == "assistant" for b in bounds)
            msgs = json.loads(r["messages_json"])
            # The prompt text is the kit's chat template rendering of the first message.
            assert msgs[0]["role"] == "user" and msgs[0]["content"] and msgs[0]["content"] in r["prompt"]
            assert r["response_text"] == [m for m in msgs if m["role"] == "assistant"][-1]["content"]
            assert r["finish_reason"] in ("stop", "length", "max_turns", "max_tool_calls")
            assert n <= cfg.agent.max_response_tokens
        # The SFT'd policy calls the tool, so some samples are multi-turn with masked tool tokens.
        assert any(r["tool_calls"] > 0 and 0 in r["response_mask"] for r in rows)
        # The experience lines up with the rollout's masks.
        exp = store.read_table(store.manifest("agent", it, "advantage"), "experience.parquet").to_pylist()
        assert [e["response_mask"] for e in exp] == [r["response_mask"] for r in rows]
        for e in exp:
            assert all(a == 0 for a, m in zip(e["advantages"], e["response_mask"], strict=True) if m == 0)


def test_agent_metrics_reach_mlflow(agent_run):
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for

    cfg, result = agent_run
    run = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"])
    for name in (
        "num_turns/mean",
        "tool_calls/mean",
        "tool_calls/errors",
        "tool_calls/timeouts",
        "tool_calls/success_rate",
        "response_length/mean",
        "timing_s/gen_model",
        "timing_s/gen_tools",
        "val/tool_calls/success_rate",
        "val-core/synthetic/multiply/reward/mean_at_1",
        "rollout/logprob_gap",
    ):
        assert name in run.data.metrics, name
    assert run.data.metrics["num_turns/mean"] > 1.0


def test_a_stored_trajectory_shows_its_turns_and_a_replay_reproduces_it(agent_run, capsys):
    """Each turn's seconds are stored beside its bounds; `rlstage inspect -q trajectory` shows a multi-turn sample
    turn by turn; a replay of the rollout reproduces every column but the seconds, and the reward replays from it."""
    from rlstage.flows.cli import main
    from rlstage.flows.replay import replay
    from rlstage.tasks.runtime import store_for

    cfg, _ = agent_run
    store = store_for(cfg)
    rows = store.read_table(store.manifest("agent", 2, "rollout"), "rollouts.parquet").to_pylist()
    for r in rows:
        assert len(r["turn_seconds"]) == len(r["turn_bounds"]) and all(s >= 0 for s in r["turn_seconds"])
    sample = max(rows, key=lambda r: (r["tool_calls"], r["sample_id"]))
    assert sample["tool_calls"] > 0
    capsys.readouterr()
    assert main(["inspect", "agent", "-q", "trajectory", "-i", "2", "-s", sample["sample_id"], "--store", cfg.store.root]) == 0
    shown = capsys.readouterr().out
    print(shown)  # docs/agents.md shows one such table
    roles = [b["role"] for b in sample["turn_bounds"]]
    table = [line for line in shown.splitlines() if sample["sample_id"] in line]
    assert [line.split("┆")[3].strip() for line in table] == ["user", *roles], shown  # the prompt, then each turn
    assert "tool" in roles and "multiply" in shown, shown
    replayed = replay(run_name="agent", iteration=2, stage="rollout", store_root=cfg.store.root)
    assert replayed["identical"], replayed["files_identical"]
    assert replay(run_name="agent", iteration=2, stage="reward", store_root=cfg.store.root)["identical"]
