"""The run's story as Prefect and MLflow tell it: reused stages are Cached, replays and evals are published.

One short training run (one iteration of the tiny kit), checked through the Prefect API and MLflow's client.
"""

from __future__ import annotations

import pytest

from schemas.config import load_config
from tests_support import tiny_overrides

pytestmark = pytest.mark.slow

RUN = "story"


@pytest.fixture(scope="module")
def story_run(prefect_api, tmp_path_factory):
    from flows.training import train

    root = str(tmp_path_factory.mktemp("story") / "store")
    cfg = load_config(None, [f"store.root={root}", f"run_name={RUN}", *tiny_overrides(), "trainer.iterations=1"])
    first = train(config=cfg, return_state=True)
    return cfg, root, first


def _stage_states(flow_state) -> dict[tuple[str, str], object]:
    """(flow run name, stage) -> final state of each stage task run of a training flow run and its subflows."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    from tasks.stages import TASKS

    with get_client(sync_client=True) as client:
        top = client.read_flow_run(flow_state.state_details.flow_run_id)
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[top.id]))
        )
        names = {r.id: r.name for r in [top, *children]}
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(names))))
    out = {}
    for tr in runs:
        stage = tr.name.rsplit("-", 1)[0]
        if stage in TASKS:
            out[(names[tr.flow_run_id], stage)] = tr.state
    return out


def test_reused_stages_are_cached_in_prefect_and_executed_ones_completed(story_run):
    from flows.training import train
    from tasks.runtime import store_for

    cfg, _, first = story_run
    ran = _stage_states(first)
    iteration = f"{RUN}-iter-1"
    assert {(iteration, s) for s in ("rollout", "reward", "advantage", "update", "eval")} <= set(ran)
    assert {state.name for state in ran.values()} == {"Completed"}, ran
    store = store_for(cfg)
    store.delete(RUN, 1, "eval")  # the second pass executes that one stage and reuses every other
    second = _stage_states(train(config=cfg, return_state=True))
    assert set(second) == set(ran)
    for (flow_run, stage), state in second.items():
        if (flow_run, stage) == (iteration, "eval"):
            assert state.name == "Completed"
        else:
            assert state.name == "Cached" and state.is_completed(), (flow_run, stage, state)
    # Prefect's cache key is the stage's own key, from its committed manifest
    for stage in ("rollout", "reward", "advantage", "update"):
        assert second[(iteration, stage)].state_details.cache_key == store.manifest(RUN, 1, stage).key
    top = next(name for name, stage in second if stage == "data_prep")
    assert second[(top, "data_prep")].state_details.cache_key == store.manifest(RUN, None, "data_prep").key


def test_replay_publishes_a_prefect_artifact_and_a_nested_mlflow_run(story_run):
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from flows.replay import format_summary, replay
    from infra.tracking import log_result, tracking_uri_for

    cfg, root, _ = story_run
    summary = replay(run_name=RUN, iteration=1, stage="reward", store_root=root)
    assert summary["identical"] and summary["prefect_artifact"] == f"{RUN}-replay"
    art = Artifact.get(f"{RUN}-replay")
    assert art is not None and art.type == "markdown"
    text = str(art.data)
    assert "Replay of `reward`, iteration 1" in text and "**equal**" in text
    assert "| rewards.parquet | yes |" in text and "| critic/score/mean |" in text
    client = MlflowClient(tracking_uri_for(cfg))
    nested = client.get_run(summary["mlflow_run_id"])
    parent = client.get_run(nested.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["rlstage.run_name"] == RUN
    assert nested.data.metrics["replay/reward/identical"] == 1.0 and "critic/score/mean" in nested.data.metrics
    assert nested.data.tags["rlstage.replay.identical"] == "true"
    assert "published: Prefect artifact story-replay, MLflow run" in format_summary(summary)
    # a result recorded before (the same replay again, answered from its committed version) is recorded once
    again = log_result(cfg, "again", f"replay/1/reward/{summary['version']}", {"x": 1.0}, 1, {}, {})
    assert again == nested.info.run_id and "x" not in client.get_run(again).data.metrics


def test_eval_publishes_its_metrics_as_a_prefect_table_and_a_nested_mlflow_run(story_run):
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from flows.evaluate import evaluate_run
    from infra.tracking import tracking_uri_for

    cfg, root, _ = story_run
    result = evaluate_run(run_name=RUN, iteration=1, store_root=root)
    assert result["prefect_artifact"] == f"{RUN}-eval"
    art = Artifact.get(f"{RUN}-eval")
    assert art is not None and art.type == "table"
    text = str(art.data)
    assert "val/accuracy" in text and result["version"] in text
    client = MlflowClient(tracking_uri_for(cfg))
    nested = client.get_run(result["mlflow_run_id"])
    assert client.get_run(nested.data.tags["mlflow.parentRunId"]).data.tags["rlstage.run_name"] == RUN
    history = client.get_metric_history(nested.info.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in history] == [(1, result["metrics"]["val/accuracy"])]
