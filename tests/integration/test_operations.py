"""Operating a run: nightly continuation, stage replay, one run at a time."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rlstage.schemas.config import ConfigError, load_config
from tests_support import moving_overrides, tiny_overrides, update_weights, weights_moved

TINY = tiny_overrides() + moving_overrides()  # replays of runs whose weights move



def flow_run_names(prefix: str) -> set[str]:
    """Names of the flow runs starting with ``prefix`` in the session's Prefect API."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{prefix}%")))
    return {r.name for r in runs}


@pytest.fixture(scope="module")
def ops_run(prefect_api, tmp_path_factory):
    from rlstage.flows.training import train

    root = str(tmp_path_factory.mktemp("ops") / "store")
    overrides = [f"store.root={root}", "run_name=ops", *TINY, "trainer.iterations=1"]
    cfg = load_config(None, overrides)
    first = train(config=cfg)
    from safetensors.torch import load

    from rlstage.tasks.runtime import store_for

    store = store_for(cfg)
    start = store.manifest("ops", 1, "update").meta["policy_ref"]
    init = store.manifest(start["run"], start["iteration"], start["stage"])
    assert weights_moved(load(store.read_bytes(init, "model/model.safetensors")), update_weights(store, "ops", 1))
    return cfg, root, first


def test_nightly_continues_without_gap_or_repeat(ops_run):
    from mlflow.tracking import MlflowClient

    from rlstage.flows.nightly import nightly
    from rlstage.infra.tracking import tracking_uri_for

    cfg, root, first = ops_run
    second = nightly(run_name="ops", iterations=1, store_root=root)
    third = nightly(run_name="ops", iterations=1, store_root=root)
    assert [h["iteration"] for h in second["history"]] == [2]
    assert [h["iteration"] for h in third["history"]] == [3]
    assert first["mlflow_run_id"] == second["mlflow_run_id"] == third["mlflow_run_id"]
    client = MlflowClient(tracking_uri_for(cfg))
    steps = [m.step for m in client.get_metric_history(first["mlflow_run_id"], "actor/pg_loss")]
    assert sorted(steps) == [1, 2, 3]


def test_a_run_whose_lr_decays_over_its_length_continues_only_up_to_it():
    from rlstage.flows.checks import continuation_end

    constant = load_config(None, ["run_name=c", "trainer.iterations=4"])
    assert continuation_end(constant, 4, 3) == 7  # nothing reads the length: any continuation
    fixed = load_config(None, ["run_name=c", "trainer.iterations=4", "actor.optim.lr_schedule=linear", "actor.optim.total_steps=99"])
    assert continuation_end(fixed, 4, 3) == 7  # the schedule's length is its own
    decaying = load_config(None, ["run_name=d", "trainer.iterations=4", "actor.optim.lr_schedule=cosine"])
    assert continuation_end(decaying, 1, 2) == 3
    assert continuation_end(decaying, 3, 5) == 4  # up to the planned length, where the lr reaches its end
    with pytest.raises(ConfigError, match=r"run 'd' has run all its trainer\.iterations=4, over which its lr decays"):
        continuation_end(decaying, 4, 1)


def test_nightly_refuses_a_conflicting_config(ops_run):
    from rlstage.flows.nightly import nightly

    _, root, _ = ops_run
    with pytest.raises(ConfigError, match="conflicts with its stored config"):
        nightly(run_name="ops", iterations=1, store_root=root, overrides=[*TINY, "actor.optim.lr=0.5"])


@pytest.mark.invariant("replayed == stored", "every file's checksum (tables equal but for their timing columns)")
@pytest.mark.parametrize("stage", ["rollout", "reward", "advantage", "update", "eval"])
def test_replay_with_stored_config_reproduces_checksums(ops_run, stage):
    from rlstage.flows.replay import replay, replay_version
    from rlstage.workers.group import actor_name

    _, root, _ = ops_run
    workers = _actors_named(name := actor_name("ops", root, replay_version([])))  # the replays' workers, so far
    summary = replay(run_name="ops", iteration=1, stage=stage, store_root=root)
    assert summary["version"] == replay_version([])
    assert summary["identical"], summary["files_identical"]
    # scoring needs no policy: the reward's replay started no worker; the policy's stages one each
    assert _actors_named(name) == workers + (stage != "reward")


def test_replay_with_changed_settings_writes_a_sibling_version(ops_run):
    """A sibling version, the original untouched; published as a Prefect artifact of the run and an MLflow run
    nested in the run's own (infra/story.py)."""
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from rlstage.flows.replay import format_summary, replay
    from rlstage.infra.tracking import log_result, tracking_uri_for
    from rlstage.tasks.runtime import store_for

    cfg, root, first = ops_run
    store = store_for(cfg)
    original = store.manifest("ops", 1, "update")
    summary = replay(run_name="ops", iteration=1, stage="update", store_root=root, overrides=["actor.entropy_coeff=0.05"])
    assert not summary["identical"]
    assert summary["files_identical"]["model/config.json"]  # same architecture, other weights
    assert not summary["files_identical"]["model/model.safetensors"]
    sibling = store.manifest("ops", 1, "update", version=summary["version"])
    assert sibling.meta["replay_of"] == original.artifact_id
    assert sibling.meta["overrides"] == ["actor.entropy_coeff=0.05"]
    assert store.manifest("ops", 1, "update").artifact_id == original.artifact_id  # untouched
    versions = store.versions("ops", 1, "update")
    assert versions[0] == "main" and summary["version"] in versions
    assert "actor/entropy:" in format_summary(summary)
    assert "published: Prefect artifact ops-replay, MLflow run" in format_summary(summary)

    assert summary["prefect_artifact"] == "ops-replay"
    text = str(Artifact.get("ops-replay").data)
    assert "Replay of `update`, iteration 1" in text and "**differ**" in text and "actor.entropy_coeff=0.05" in text
    assert "| model/model.safetensors | no |" in text and "| model/config.json | yes |" in text
    assert "| actor/entropy |" in text
    client = MlflowClient(tracking_uri_for(cfg))
    nested = client.get_run(summary["mlflow_run_id"])
    assert nested.data.tags["mlflow.parentRunId"] == first["mlflow_run_id"]
    assert nested.data.metrics["replay/update/identical"] == 0.0 and "actor/entropy" in nested.data.metrics
    assert nested.data.params["overrides"] == "actor.entropy_coeff=0.05"
    # the same result again (the same replay, answered from its committed version) is recorded once
    again = log_result(cfg, "again", f"replay/1/update/{summary['version']}", {"x": 1.0}, 1, {}, {})
    assert again == nested.info.run_id and "x" not in client.get_run(again).data.metrics
    assert "ops replay of update, iteration 1" in flow_run_names("ops replay")  # not `tiny-kagu`


def test_replay_of_missing_stage_or_iteration_is_a_clear_error(ops_run):
    from rlstage.flows.replay import replay

    _, root, _ = ops_run
    with pytest.raises(ConfigError, match="no committed update at iteration 99"):
        replay(run_name="ops", iteration=99, stage="update", store_root=root)
    with pytest.raises(ConfigError, match="cannot be replayed"):
        replay(run_name="ops", iteration=1, stage="train", store_root=root)
    with pytest.raises(ConfigError, match="does not exist"):
        replay(run_name="nope", iteration=1, stage="reward", store_root=root)


def test_second_flow_on_the_same_run_is_refused(ops_run, capsys):
    from rlstage.flows.training import train
    from rlstage.infra.lease import RunLocked
    from rlstage.tasks.runtime import store_for

    cfg, _, _ = ops_run
    store = store_for(cfg)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket
        import time

        store.put_json(
            "ops",
            "lease",
            {"token": "x", "host": socket.gethostname(), "pid": holder.pid, "label": "other", "expires_at": time.time() + 60},
        )
        with pytest.raises(RunLocked, match="already running"):
            train(config=cfg)
        # The command is refused before anything starts: one line naming the holder and its lease's seconds, no flow
        # run left behind (before: 18.8 s of a Prefect server started, then a Failed flow run named like the live one).
        from prefect import get_client

        from rlstage.flows.cli import main

        with get_client(sync_client=True) as client:
            runs_before = len(client.read_flow_runs(limit=200))
        capsys.readouterr()
        assert main(["nightly", "ops", "--store", cfg.store.root]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid} on {socket.gethostname()}" in err[0], err
        assert re.search(r"its lease expires \d+ s after its holder stops renewing it$", err[0]), err
        with get_client(sync_client=True) as client:
            assert len(client.read_flow_runs(limit=200)) == runs_before
    finally:
        holder.kill()
        holder.wait()
    # the holder died: its lease no longer blocks the run
    again = train(config=cfg)
    assert again["executed"] == []
    assert store.get_json("ops", "lease") is None


def _actors_named(name: str) -> int:
    """Workers groups of that name were given in this process, fresh or warm ones (workers/pool.py)."""
    from rlstage.workers.pool import bound_count

    return bound_count(name)


def test_eval_flow_scores_a_stored_policy_into_a_sibling_version(ops_run):
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact

    from rlstage.flows.evaluate import evaluate_run
    from rlstage.infra.store import ArtifactStore
    from rlstage.infra.tracking import tracking_uri_for
    from rlstage.workers.group import actor_name

    cfg, root, first = ops_run
    store = ArtifactStore(root)
    logged = store.manifest("ops", 1, "eval")
    again = evaluate_run(run_name="ops", iteration=1, store_root=root)
    # the stored settings reproduce the run's own evaluation, in a sibling version
    assert again["executed"] and again["version"].startswith("eval-")
    assert again["metrics"]["val/accuracy"] == logged.meta["metrics"]["val/accuracy"]
    assert store.manifest("ops", 1, "eval").artifact_id == logged.artifact_id  # the original is untouched
    more = evaluate_run(run_name="ops", iteration=0, store_root=root, overrides=["trainer.eval_n=3"])
    assert more["iteration"] == 0 and "val-core/synthetic/addition/reward/mean@3" in more["metrics"]
    workers = _actors_named(actor_name("ops", root, more["version"]))
    assert workers == 1  # the eval that computed started its policy worker
    same = evaluate_run(run_name="ops", iteration=0, store_root=root, overrides=["trainer.eval_n=3"])
    assert not same["executed"]
    assert _actors_named(actor_name("ops", root, more["version"])) == workers  # a committed eval starts none
    # published: a table artifact of the run (the latest evaluation) and a nested MLflow run, recorded once
    assert same["prefect_artifact"] == "ops-eval" and same["mlflow_run_id"] == more["mlflow_run_id"]
    text = str(Artifact.get("ops-eval").data)
    assert "val-core/synthetic/addition/reward/mean@3" in text and more["version"] in text
    client = MlflowClient(tracking_uri_for(cfg))
    nested = client.get_run(again["mlflow_run_id"])
    assert nested.data.tags["mlflow.parentRunId"] == first["mlflow_run_id"]
    history = client.get_metric_history(nested.info.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in history] == [(1, again["metrics"]["val/accuracy"])]
    with pytest.raises(ConfigError, match="iteration: run 'ops' has policies for 0.."):
        evaluate_run(run_name="ops", iteration=99, store_root=root)
    assert {"ops eval of iteration 1", "ops eval of iteration 0"} <= flow_run_names("ops eval")
    # a partial-credit rule (a wrong number earns the 0.1 format score): accuracy is the share scored correct,
    # the mean reward is reported beside it under its own name
    credit = ["reward.function=gsm8k", "reward.gsm8k_method=flexible", "reward.format_score=0.1"]
    partial = evaluate_run(run_name="ops", iteration=1, store_root=root, overrides=credit)
    scores = store.read_table(store.manifest("ops", 1, "eval", version=partial["version"]), "eval.parquet")
    greedy = [s for s, i in zip(scores["score"].to_pylist(), scores["sample_index"].to_pylist(), strict=True) if i == -1]
    assert 0.1 in [round(s, 6) for s in greedy]  # some answers earned only the format credit
    assert partial["metrics"]["val/accuracy"] == pytest.approx(sum(s > 0.5 for s in greedy) / len(greedy))
    assert partial["metrics"]["val/reward_mean"] == pytest.approx(sum(greedy) / len(greedy))
    assert partial["metrics"]["val/reward_mean"] > partial["metrics"]["val/accuracy"]
    with pytest.raises(ConfigError, match="store.root: an evaluation cannot change it"):
        evaluate_run(run_name="ops", store_root=root, overrides=["store.root=/elsewhere"])


def test_data_prep_flow_commits_prompts_that_training_reuses(prefect_api, tmp_path):
    from rlstage.flows.data_prep import prepare_data
    from rlstage.infra.store import ArtifactStore

    overrides = [f"store.root={tmp_path}", "run_name=prep", *TINY]
    first = prepare_data(overrides=overrides)
    assert first["executed"] and first["train_rows"] > 0 and first["test_rows"] > 0
    assert not prepare_data(overrides=overrides)["executed"]  # committed once
    assert "prep data prep" in flow_run_names("prep data")
    m = ArtifactStore(str(tmp_path)).manifest("prep", None, "data_prep")
    assert m is not None and ArtifactStore(str(tmp_path)).read_table(m, "train.parquet").num_rows == first["train_rows"]
    with pytest.raises(ConfigError, match="exists with another config"):
        prepare_data(overrides=[*overrides, "kit.digits=3"])
