"""A real `mlflow server` that goes away mid-run: the run goes on, and its MLflow run catches up from the
store once the server answers again, each iteration's point logged once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rlstage.schemas.config import load_config
from tests_support import moving_overrides, tiny_overrides


class MlflowServer:
    def __init__(self, home: Path, port: int) -> None:
        self.home, self.port, self.proc = home, port, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        from rlstage.infra.prefect_server import wait_http
        from rlstage.infra.ui import start_mlflow_server

        self.proc = start_mlflow_server(self.home, self.port, self.home / "server.log")
        wait_http(f"{self.url}/health", 180, self.proc)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_a_tracking_server_lost_mid_run_is_caught_up_from_the_store(prefect_api, tmp_path, capfd):
    from mlflow.tracking import MlflowClient

    from rlstage.flows.nightly import nightly
    from rlstage.flows.records import PROGRESS
    from rlstage.flows.training import train
    from rlstage.infra.env import free_port
    from rlstage.tasks.kit import kit_run_name
    from rlstage.tasks.runtime import store_for

    server = MlflowServer(tmp_path, free_port())
    server.start()
    try:
        def cfg(iterations: int):
            return load_config(
                None,
                [
                    f"store.root={tmp_path / 'store'}", "run_name=away", *tiny_overrides(), *moving_overrides(),
                    f"tracking.tracking_uri={server.url}", f"trainer.iterations={iterations}",
                ],
            )  # fmt: skip

        first = train(config=cfg(1))
        store = store_for(cfg(1))

        def kill_when_iteration_2_rolls_out() -> None:
            while store.manifest("away", 2, "rollout") is None:
                time.sleep(0.1)
            server.kill()

        killer = threading.Thread(target=kill_when_iteration_2_rolls_out, daemon=True)
        killer.start()
        # The server goes away in iteration 2: iterations 2 and 3 train and commit, with a warning line.
        away = train(config=cfg(3))
        killer.join()
        assert [h["iteration"] for h in away["history"] if h["executed"]] == [2, 3]
        assert "the run goes on" in capfd.readouterr().err
        server.start()
        # The nightly path starts at iteration 4: what MLflow lacks is logged from the store first.
        back = nightly(run_name="away", iterations=1, store_root=str(tmp_path / "store"))
        assert [h["iteration"] for h in back["history"]] == [4]
        assert "MLflow caught up with iteration(s) 2, 3 from the store" in capfd.readouterr().err
        # The CLI's path walks every iteration again: nothing executes, nothing is logged twice.
        again = train(config=cfg(4))
        assert not any(h["executed"] for h in again["history"])
        client = MlflowClient(server.url)
        run_id = first["mlflow_run_id"]
        assert back["mlflow_run_id"] == again["mlflow_run_id"] == run_id
        progress = sorted(m.step for m in client.get_metric_history(run_id, PROGRESS))
        pg = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "actor/pg_loss"))
        sft = [(m.step, m.value) for m in client.get_metric_history(run_id, "sft/test_accuracy")]
        run = client.get_run(run_id)
        models = {m.params["iteration"]: m for m in client.search_logged_models([run.info.experiment_id])}
        model_metrics = {(m.key, m.step) for m in client.get_logged_model(models["4"].model_id).metrics} if "4" in models else set()
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert progress == [0, 1, 2, 3, 4], progress
    assert [s for s, _ in pg] == [1, 2, 3, 4]  # each iteration's point once
    assert dict(pg)[2] == pytest.approx(store.manifest("away", 2, "update").meta["metrics"]["actor/pg_loss"])
    # SFT's metrics at step 0; the prompts as dataset inputs, by reference to the store's files.
    assert [s for s, _ in sft] == [0] and sft[0][1] == pytest.approx(store.manifest(kit_run_name(cfg(1)), None, "sft").meta["metrics"]["sft/test_accuracy"])
    prompts = store.manifest("away", None, "data_prep")
    assert {i.dataset.digest for i in run.inputs.dataset_inputs} == {prompts.files[f].sha256[:32] for f in ("train.parquet", "test.parquet")}
    # Each invocation's final policy is a logged model pointing at its update artifact (not iteration 3's:
    # it ended while the server was away), with the metrics of its iteration.
    assert sorted(models) == ["1", "4"], sorted(models)
    assert models["4"].params["checkpoint"] == store.artifact_dir("away", 4, "update")
    assert {("actor/pg_loss", 4), ("val/accuracy", 4)} <= model_metrics, model_metrics
    # Artifacts went to the server's --artifacts-destination, not beside the store.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    assert list((tmp_path / "artifacts").rglob("resolved.yaml")) and not (tmp_path / "store" / "mlflow-artifacts").exists()
