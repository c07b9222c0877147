"""infra.tracking against a SQLite MLflow store: experiment kind, source tags, resolved config."""

from __future__ import annotations

import os

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before mlflow is imported anywhere in this process

import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rlstage.infra.tracking import (
    CONFIG_ARTIFACT,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    REPO_ROOT,
    RUN_NAME_TAG,
    STORE_TAG,
    Tracker,
    TrackingUnavailable,
    log_result,
)
from rlstage.schemas.config import load_config


def _cfg(tmp_path, *extra):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return load_config(None, [f"store.root={tmp_path / 'store'}", f"tracking.tracking_uri={uri}", "run_name=tr", *extra])


def _config_artifact(client: MlflowClient, run_id: str, tmp_path) -> dict:
    path = client.download_artifacts(run_id, CONFIG_ARTIFACT, str(tmp_path))
    with open(path) as f:
        return yaml.safe_load(f)


def test_kind_source_and_resolved_config(tmp_path):
    cfg = _cfg(tmp_path)
    first = Tracker(cfg, tags={"prefect.flow_run_id": "a"})
    first.finish()
    client = MlflowClient(first.uri)
    exp = client.get_experiment(first.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    tags = client.get_run(first.run_id).data.tags
    assert tags["mlflow.source.git.commit"] == head and len(head) == 40
    assert tags["mlflow.source.type"] == "PROJECT" and tags["mlflow.source.name"] == "rlstage"
    assert tags["prefect.flow_run_id"] == "a"  # the invocation's own tags, on a new run as on a continued one
    assert _config_artifact(client, first.run_id, tmp_path / "a") == cfg.model_dump(mode="json")

    # A continuation with more iterations: the same run, its config artifact now the new one.
    more = _cfg(tmp_path, "trainer.iterations=7")
    again = Tracker(more, tags={"prefect.flow_run_id": "b"})
    assert again.run_id == first.run_id
    assert _config_artifact(client, again.run_id, tmp_path / "b")["trainer"]["iterations"] == 7
    assert client.get_run(again.run_id).data.tags["prefect.flow_run_id"] == "b"


def test_existing_experiment_gets_a_kind_unless_it_has_one(tmp_path):
    cfg = _cfg(tmp_path)
    client = MlflowClient(cfg.tracking.tracking_uri)
    plain = client.create_experiment(cfg.tracking.experiment)  # e.g. made by an older rlstage
    Tracker(cfg).finish()
    assert client.get_experiment(plain).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND

    chosen = _cfg(tmp_path, "tracking.experiment=chosen")
    exp_id = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "finetuning"})  # set in the UI
    Tracker(chosen).finish()
    assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == "finetuning"


def test_a_run_is_its_store_and_its_name(tmp_path):
    """One MLflow server, two stores with a run of the same name: two MLflow runs, each continued."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def tracker(store: str) -> Tracker:
        t = Tracker(load_config(None, [f"store.root={store}", f"tracking.tracking_uri={uri}", "run_name=same"]))
        t.log_metrics(1, {"x": 1.0})
        t.finish()
        return t

    a, b = tracker(str(tmp_path / "a")), tracker(str(tmp_path / "b"))
    assert a.run_id != b.run_id
    assert tracker(str(tmp_path / "a")).run_id == a.run_id
    assert tracker(f"file://{tmp_path / 'b'}").run_id == b.run_id
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(b.run_id, "x")] == [1, 1]

    # A run recorded before runs carried their store is continued, and gets the tag.
    exp_id = a.experiment_id
    old = client.create_run(exp_id, run_name="legacy", tags={RUN_NAME_TAG: "legacy"}).info.run_id
    cfg = load_config(None, [f"store.root={tmp_path / 'c'}", f"tracking.tracking_uri={uri}", "run_name=legacy"])
    assert Tracker(cfg).run_id == old
    assert client.get_run(old).data.tags[STORE_TAG] == str((tmp_path / "c").resolve())


def test_a_result_is_a_nested_run_recorded_once(tmp_path):
    """A replay's or an eval's result: an MLflow run nested in the training run's, not logged twice."""
    cfg = _cfg(tmp_path)
    parent = Tracker(cfg)
    parent.finish()
    first = log_result(cfg, "replay reward iter-1 v", "replay/1/reward/v", {"replay/reward/identical": 1.0}, 1, {"t": "x"}, {"overrides": ""})
    again = log_result(cfg, "replay reward iter-1 v", "replay/1/reward/v", {"replay/reward/identical": 0.0}, 1, {}, {})
    client = MlflowClient(parent.uri)
    run = client.get_run(first)
    assert again == first and run.data.tags["mlflow.parentRunId"] == parent.run_id and run.data.tags["t"] == "x"
    assert [m.value for m in client.get_metric_history(first, "replay/reward/identical")] == [1.0]
    assert RUN_NAME_TAG not in run.data.tags  # the run's own MLflow run stays the only one named after it


def test_a_result_for_an_unreachable_server_fails_fast(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(None, [f"store.root={tmp_path}", f"tracking.tracking_uri=http://127.0.0.1:{port}", "run_name=tr"])
    with pytest.raises(TrackingUnavailable, match=f"127.0.0.1:{port} is unreachable"):
        log_result(cfg, "n", "r", {}, 1, {}, {})


def test_prompts_are_dataset_inputs_and_a_checkpoint_is_a_logged_model_by_reference(tmp_path):
    import json

    import pyarrow as pa

    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.artifacts import PROMPTS

    cfg = _cfg(tmp_path)
    store = ArtifactStore(str(tmp_path / "store"))
    rows = {f.name: [None] * 2 for f in PROMPTS}
    rows.update(prompt_id=["a", "b"], prompt=["1+1=", "2+2="], ground_truth=["2", "4"])
    table = pa.Table.from_pydict(rows, schema=PROMPTS)
    commit = {"key": "k", "config_hash": "c", "code_version": "v", "inputs": {}}
    prompts = store.commit("tr", None, "data_prep", tables={"train.parquet": table, "test.parquet": table.slice(1)}, **commit)
    between = store.commit("tr", 1, "update", tables={"metrics.parquet": pa.table({"x": [1.0]})}, **commit)
    update = store.commit(
        "tr", 2, "update", tables={"metrics.parquet": pa.table({"x": [1.0]})}, blobs={"model/model.safetensors": b"w" * 10}, **commit
    )

    tracker = Tracker(cfg)
    for _ in range(2):  # a continuation logs nothing twice
        tracker.log_prompts(store, prompts)
        model_id = tracker.log_policy(store, update, "model")
    assert tracker.log_policy(store, between, "model") is None  # no weights in it: nothing to point at
    tracker.log_metrics(2, {"val/accuracy": 0.75}, model_id=model_id)
    tracker.finish()

    client = MlflowClient(tracker.uri)
    inputs = client.get_run(tracker.run_id).inputs.dataset_inputs
    got = {i.tags[0].value: i.dataset for i in inputs}
    assert sorted(got) == ["evaluation", "training"] and len(inputs) == 2
    assert got["training"].name == "tr/train" and prompts.files["train.parquet"].sha256.startswith(got["training"].digest)
    assert json.loads(got["training"].source)["uri"] == store.uri(prompts, "train.parquet")
    assert [c["name"] for c in json.loads(got["evaluation"].schema)["mlflow_colspec"]] == PROMPTS.names

    models = client.search_logged_models([tracker.experiment_id])
    assert [m.model_id for m in models] == [model_id] and models[0].source_run_id == tracker.run_id
    assert models[0].params == {"iteration": "2", "checkpoint": store.artifact_dir("tr", 2, "update")}
    assert [(m.key, m.value, m.step) for m in client.get_logged_model(model_id).metrics] == [("val/accuracy", 0.75, 2)]
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(f"{models[0].artifact_location}/checkpoint.json", dst_path=str(tmp_path / "m"), tracking_uri=tracker.uri)
    files = json.loads(Path(local).read_text())["files"]
    entry = update.files["model/model.safetensors"]
    assert files == {"model/model.safetensors": {"uri": store.uri(update, "model/model.safetensors"), "sha256": entry.sha256, "bytes": 10}}


def test_bookkeeping_runs_jobs_in_order_later_and_surfaces_a_failure(capfd):
    import threading
    import time

    from rlstage.infra.bookkeeping import Bookkeeper

    done: list[int] = []
    books = Bookkeeper(delay_s=0.3)
    submitted = time.monotonic()
    started = threading.Event()
    books.submit(lambda: (started.set(), done.append(1)))
    books.submit(lambda: done.append(2))
    assert started.wait(5) and time.monotonic() - submitted >= 0.3  # held back by its delay, then run
    books.close()
    assert done == [1, 2]

    def fail() -> None:
        raise RuntimeError("tracking said no")

    books = Bookkeeper(delay_s=60.0)  # closing runs what waits at once
    books.submit(lambda: done.append(3))
    books.submit(fail)
    books.submit(lambda: done.append(4))  # a failed job does not lose the later ones
    with pytest.raises(RuntimeError, match="tracking said no"):
        books.close()
    assert done == [1, 2, 3, 4]

    books = Bookkeeper()
    books.submit(fail)
    for _ in range(100):
        time.sleep(0.02)
        if books._jobs[0].done():
            break
    with pytest.raises(RuntimeError, match="tracking said no"):  # the next submit raises it
        books.submit(lambda: done.append(5))
    books.submit(fail)
    books.close(raise_errors=False)  # another error ends the run: this one is a line, not a second raise
    assert "run bookkeeping failed: tracking said no" in capfd.readouterr().err
