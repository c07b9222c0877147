"""Hostile agents in a run: the failed samples are samples the stage trains past, and logs."""

from __future__ import annotations

import logging

import pytest
from test_agent_function_pipeline import AGENT

from rlstage.schemas.config import load_config
from tests_support import moving_overrides, stage_rows, tiny_overrides

# ---------------------------------------------------------------- agents that grade themselves, fail or ask wrongly

MIXED = """
from rlstage.engines.agents.examples import calculator_agent


async def mixed(client, sample):
    i, k = map(int, sample.sample_id.split("-")[1:])
    if k == 1:
        raise RuntimeError("the agent's own bug")
    if k == 2:  # garbage, or a number without a single request (no reward)
        return "garbage" if i % 2 == 0 else 1.0
    if k == 3:  # a wrong model name first: a 404, then the agent goes on
        try:
            await client.chat.completions.create(model="gpt-4o", messages=sample.messages)
        except Exception:
            pass
    await calculator_agent(client, sample)
    return 0.75 if k == 0 else None  # sample 0 grades itself; sample 3 leaves it to the rule
"""


@pytest.fixture(scope="module")
def mixed_run(prefect_api, tmp_path_factory):
    """One iteration with agents that grade themselves, raise, return garbage or nothing asked, or ask for another
    model. Their
    module must import here and in Ray's workers: on sys.path, and on PYTHONPATH for a Ray started again."""
    import os
    import sys

    import ray

    from rlstage.flows.training import train

    tmp = tmp_path_factory.mktemp("agent-mixed")
    (tmp / "mixed_agents.py").write_text(MIXED)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), old) if p)
    sys.path.insert(0, str(tmp))
    ray.shutdown()
    try:
        cfg = load_config(
            None,
            [f"store.root={tmp / 'store'}", "run_name=mixed", *tiny_overrides(), *moving_overrides(), *AGENT,
             "agent.function=mixed_agents:mixed", "trainer.iterations=1"],
        )  # fmt: skip
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append  # the task run logger's records (tests do not ship logs to the Prefect API)
        logger = logging.getLogger("prefect.task_runs")
        logger.addHandler(handler)
        try:
            yield cfg, train(config=cfg), records
        finally:
            logger.removeHandler(handler)
    finally:
        ray.shutdown()
        sys.path.remove(str(tmp))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def test_failed_agents_are_samples_the_stage_trains_past_and_logs(mixed_run):
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for

    cfg, result, records = mixed_run
    rows = stage_rows(cfg, "mixed", 1, "rollout", "rollouts.parquet")
    scores = stage_rows(cfg, "mixed", 1, "reward", "rewards.parquet")
    assert stage_rows(cfg, "mixed", 1, "update", "metrics.parquet")  # the update trained past the failed samples
    for r, s in zip(rows, scores, strict=True):
        k = r["sample_index"]
        if k in (1, 2):  # failed: reward 0 (the 1.0 of one that never asked included), no trained token
            assert r["agent_reward"] == 0.0 and s["score"] == 0.0 and set(r["response_mask"]) == {0}
        elif k == 0:  # graded by the agent
            assert r["agent_reward"] == 0.75 and s["score"] == 0.75 and s["reward_fn"] == "agent.function"
        else:  # scored by the rule
            assert r["agent_reward"] is None and s["reward_fn"] != "agent.function" and 1 in r["response_mask"]
    # the failure's kind is in both tables, and a failed sample is not in its group's baseline: each group's healthy
    # samples get GRPO's advantages of their own scores alone
    assert {(r["sample_index"], r["failure"]) for r in rows} == {
        (0, None), (1, "raised"), (2, "bad_return"), (2, "no_request"), (3, None)
    }  # fmt: skip
    assert [r["failure"] for r in rows] == [s["failure"] for s in scores]
    exp = {e["sample_id"]: e for e in stage_rows(cfg, "mixed", 1, "advantage", "experience.parquet")}
    for g in {r["group_id"] for r in rows}:
        healthy = [(r["sample_id"], s["score"]) for r, s in zip(rows, scores, strict=True) if r["group_id"] == g and r["failure"] is None]
        mean = sum(v for _, v in healthy) / len(healthy)
        std = (sum((v - mean) ** 2 for _, v in healthy) / (len(healthy) - 1)) ** 0.5
        for sid, v in healthy:
            got = exp[sid]["advantages"][0]
            assert abs(got - (v - mean) / (std + 1e-6)) < 1e-4, (g, sid, got, v, mean, std)
    from rlstage.infra.explore import Experience, run_query
    from rlstage.tasks.runtime import store_for

    worst = run_query(Experience.open(store_for(cfg), "mixed"), "worst", 40).collect()  # rlstage inspect mixed -q worst
    assert set(worst["failure"].to_list()) >= {"raised", "bad_return", "no_request"}  # a failure never reads as an ordinary 0.0
    metrics = MlflowClient(tracking_uri_for(cfg)).get_run(result["mlflow_run_id"]).data.metrics
    counts = [metrics.get(f"agent/status/{kind}") for kind in ("ok", "raised", "bad_return", "no_request")]
    assert counts == [16, 8, 4, 4], counts
    assert metrics["agent/rejected/model_not_found"] == 8
    logs = [r.getMessage() for r in records if r.levelno == logging.WARNING]  # the stage task runs' log
    assert sum("HTTP 404 model_not_found" in m and "'gpt-4o'" in m for m in logs) == 8
    assert sum("raised RuntimeError: the agent's own bug" in m for m in logs) == 8
    assert sum("returned str 'garbage'" in m for m in logs) == 4

