"""The pipeline end to end on CPU: Prefect (real server) + Ray (local) + store + MLflow."""

from __future__ import annotations

import pytest

from rlstage.schemas.config import ConfigError, PolicyLossConfig, load_config
from rlstage.schemas.stages import STAGE_FILES, spec
from tests_support import REPO, flow_graph, stage_states, tiny_overrides


def _cfg(tmp_path, *extra):
    return load_config(None, [f"store.root={tmp_path / 'store'}", "run_name=it", *TINY, *extra])


TINY = tiny_overrides()


@pytest.fixture(scope="module")
def first_run(prefect_api, tmp_path_factory):
    from rlstage.flows.training import train

    tmp = tmp_path_factory.mktemp("pipeline")
    cfg = _cfg(tmp)
    state = train(config=cfg, return_state=True)
    # Where data prep executed, its result's values are in the prompts every iteration gets: still a chain.
    graph = flow_graph(state)
    assert graph["it-iter-1"] == {"it-iter-0"} and graph["it-iter-2"] == {"it-iter-1/update"}
    return cfg, state.result()


def test_two_iterations_commit_every_artifact(first_run):
    from rlstage.tasks.runtime import store_for

    cfg, result = first_run
    store = store_for(cfg)
    assert "data_prep" in result["executed"] and "sft" in result["executed"]
    for it in (1, 2):
        for stage, fname in STAGE_FILES.items():
            if stage == "critic" or not spec(stage).active(cfg):  # grpo runs without a critic, or dynamic sampling
                continue
            m = store.manifest("it", it, stage)
            assert m is not None, f"iter {it} {stage} not committed"
            table = store.read_table(m, fname)  # verifies the checksum
            assert table.num_rows > 0
        rollouts = store.read_table(store.manifest("it", it, "rollout"), "rollouts.parquet")
        assert rollouts.num_rows == 8 * 4
        update = store.manifest("it", it, "update")
        assert "model/model.safetensors" in update.files and "trainer_state/trainer_state.safetensors" in update.files
        # lineage: each stage records the artifact ids it read
        adv = store.manifest("it", it, "advantage")
        assert adv.inputs["rollouts"] == store.manifest("it", it, "rollout").artifact_id
        assert update.inputs["experience"] == adv.artifact_id
    assert store.manifest("it", 2, "rollout").inputs["policy"] == store.manifest("it", 1, "update").artifact_id
    assert store.manifest("it", 0, "eval") is not None  # the starting policy is evaluated too
    assert store.get_json("it", "run.json")["config"]["run_name"] == "it"


def test_mlflow_has_metrics_params_and_tags(first_run):
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import tracking_uri_for

    cfg, result = first_run
    client = MlflowClient(tracking_uri_for(cfg))
    run = client.get_run(result["mlflow_run_id"])
    for name in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "response_length/mean",
        "timing_s/rollout",
        "perf/throughput",
        "val-core/synthetic/addition/reward/mean_at_1",
    ):
        assert name in run.data.metrics, name
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")]
    assert steps == [1, 2]
    assert run.data.params["actor.optim.lr"] == str(cfg.actor.optim.lr)
    assert run.data.tags["rlstage.artifact_root"].endswith("store")
    assert len(run.data.tags["prefect.flow_run_id"]) == 36  # the flow run's UUID
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "rollouts")}
    assert "rollouts/iter-000001.json" in artifacts


def test_rerun_executes_nothing_then_only_after_a_deleted_artifact(first_run):
    """Also as Prefect shows it: a reused stage's task run is Cached (keyed by the stage's own cache key),
    one that ran is Completed."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    cfg, _ = first_run
    again_state = train(config=cfg, return_state=True)
    assert again_state.result()["executed"] == []
    again = stage_states(again_state)
    assert {("it-iter-2", s) for s in ("rollout", "reward", "advantage", "update", "eval")} <= set(again)
    assert {state.name for state in again.values()} == {"Cached"} and all(s.is_completed() for s in again.values())
    # The flow graph: SFT after data prep, iterations chained in order, each stage after the stages whose output it reads.
    graph = flow_graph(again_state)
    top = "it iterations 1-2"
    assert graph[f"{top}/sft"] == {f"{top}/data_prep"}
    assert graph["it-iter-0"] == {f"{top}/data_prep", f"{top}/sft"}
    # A chain, not a fan: iteration 1 after iteration 0 (eval only), iteration 2 after iteration 1's update (it
    # opens while iteration 1 evaluates).
    assert graph["it-iter-1"] == {"it-iter-0"} and graph["it-iter-2"] == {"it-iter-1/update"}
    for it in (1, 2):
        up = {s: {f"it-iter-{it}/{u}" for u in ups} for s, ups in (
            ("rollout", ()), ("reward", ("rollout",)), ("advantage", ("rollout", "reward")), ("update", ("advantage",)), ("eval", ("update",)),
        )}  # fmt: skip
        assert {s: graph[f"it-iter-{it}/{s}"] for s in up} == up
    store = store_for(cfg)
    for stage in ("rollout", "reward", "advantage", "update"):
        assert again[("it-iter-1", stage)].state_details.cache_key == store.manifest("it", 1, stage).key
    before = {s: store.manifest("it", 1, s).artifact_id for s in ("rollout", "reward")}
    store.delete("it", 2, "advantage")
    third_state = train(config=cfg, return_state=True)
    assert third_state.result()["executed"] == ["iter-2/advantage", "iter-2/update", "iter-2/eval"]
    third = stage_states(third_state)
    assert set(third) == set(again)
    ran = {key for key, state in third.items() if state.name == "Completed"}
    assert ran == {("it-iter-2", "advantage"), ("it-iter-2", "update"), ("it-iter-2", "eval")}
    assert {state.name for key, state in third.items() if key not in ran} == {"Cached"}
    assert {s: store.manifest("it", 1, s).artifact_id for s in ("rollout", "reward")} == before


def test_corrupted_artifact_is_refused(first_run, tmp_path):
    from rlstage.infra.store import ArtifactCorrupt
    from rlstage.tasks.runtime import store_for

    cfg, _ = first_run
    store = store_for(cfg)
    m = store.manifest("it", 1, "reward")
    path = store.uri(m, "rewards.parquet")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ArtifactCorrupt, match="rewards.parquet"):
        store.read_table(m, "rewards.parquet")


def test_conflicting_config_for_existing_run_is_refused(first_run):
    from rlstage.flows.training import train

    cfg, _ = first_run
    loss = PolicyLossConfig(name="vanilla", clip_ratio_high=0.28)
    other = cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"policy_loss": loss})})
    with pytest.raises(ConfigError, match="actor.clip_ratio_high"):
        train(config=other)


def test_missing_model_path_is_a_clear_error(prefect_api, tmp_path):
    from rlstage.flows.checks import InputError
    from rlstage.flows.training import train

    cfg = _cfg(tmp_path, f"model.path={tmp_path / 'no-such-model'}", "run_name=nomodel")
    with pytest.raises(InputError, match="no-such-model"):
        train(config=cfg)
    assert not (tmp_path / "store").exists()  # nothing written


def test_unwritable_store_root_is_a_clear_error(prefect_api, tmp_path):
    from rlstage.flows.training import train
    from rlstage.infra.store import StoreError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = _cfg(tmp_path, f"store.root={blocker / 'store'}")
    with pytest.raises(StoreError, match="cannot be written"):
        train(config=cfg)


def test_each_iteration_publishes_a_prefect_table_artifact(first_run):
    """One key per run for the iteration tables (the latest is the last iteration) and a run-level
    progress artifact with a row per iteration."""
    from prefect.artifacts import Artifact

    cfg, result = first_run
    art = Artifact.get("it-iteration")
    assert art is not None and art.type == "table"
    text = str(art.data)
    assert "actor/pg_loss" in text and "iter-000002/update" in text and result["mlflow_run_id"] in text
    progress = Artifact.get("it-progress")
    assert progress is not None and progress.type == "markdown"
    rows = [line for line in str(progress.data).splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [0, 1, 2]
    assert result["mlflow_run_id"] in str(progress.data)


def test_next_iteration_opens_while_the_last_one_evaluates(prefect_api, tmp_path):
    """Iteration 2's subflow is already Running in Prefect while iteration 1's eval is held in its stage, and
    none of iteration 2's stages has started; its rollout runs once that eval has been committed."""
    import os
    import subprocess
    import sys
    import time
    from datetime import datetime

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from rlstage.tasks.runtime import store_for

    markers = tmp_path / "markers"
    markers.mkdir()
    # A run name of its own: the module's other runs left flow runs named it-iter-2 on this server.
    drill = ["run_name=opens", "drill.hold_worker_at=['eval:1']", f"drill.markers={markers}"]
    cfg = _cfg(tmp_path, *drill)
    args = [f"store.root={cfg.store.root}", *TINY, *drill]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlstage.flows.cli", "train", *args], env=env, stdout=log, stderr=log)
    store = store_for(cfg)
    try:
        deadline = time.monotonic() + 300
        while not (markers / "held-eval-1").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (markers / "held-eval-1").exists(), log_path.read_text()[-3000:]
        state, deadline = None, time.monotonic() + 60
        while state != "RUNNING" and time.monotonic() < deadline:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["opens-iter-2"])))
            state = runs[0].state.type.value if runs and runs[0].state else None
            time.sleep(0.1)
        assert state == "RUNNING", log_path.read_text()[-3000:]
        time.sleep(1.0)  # held: iteration 2 waits for iteration 1's stages, however long they take
        assert store.manifest("opens", 1, "eval") is None and store.manifest("opens", 2, "rollout") is None
        (markers / "release-eval-1").touch()
        assert proc.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    created = {it: datetime.fromisoformat(store.manifest("opens", it, s).created_at) for it, s in ((1, "eval"), (2, "rollout"))}
    assert created[2] > created[1]
    assert store.manifest("opens", 2, "eval") is not None
