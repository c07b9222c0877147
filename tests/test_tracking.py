"""infra.tracking against a SQLite MLflow store: experiment kind, source tags, resolved config."""

from __future__ import annotations

import os

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before mlflow is imported anywhere in this process

import subprocess

import yaml
from mlflow.tracking import MlflowClient

from infra.tracking import CONFIG_ARTIFACT, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, REPO_ROOT, Tracker
from schemas.config import load_config


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
