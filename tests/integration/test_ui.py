"""One home (``infra/home.py``): a run trained by ``rlstage train`` is seen by ``rlstage ui`` in both UIs.

A short real run through the CLI (its own Prefect server on the home, stopped at the end), then ``rlstage ui``
on that home with its preferred Prefect port taken: the run's flow runs and logs through Prefect's API, its
metrics through MLflow's REST API, and SIGTERM stops both servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from rlstage.infra.env import free_port, pid_alive
from rlstage.infra.prefect_server import stop_process_group, wait_up
from tests_support import REPO, tiny_overrides

RUN = "seen"


@pytest.fixture(scope="module")
def ui(tmp_path_factory, migrated_home):
    tmp = tmp_path_factory.mktemp("ui")
    migrated_home(tmp / "home")
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI", "RLSTAGE_", "PREFECT_LOGGING_TO_API")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(RLSTAGE_HOME=str(tmp / "home"), PYTHONPATH=str(REPO))
    cli = [sys.executable, "-m", "rlstage.flows.cli"]
    args = [*tiny_overrides(), "trainer.iterations=1", f"run_name={RUN}", f"store.root={tmp / 'store'}"]
    t0 = time.perf_counter()
    done = subprocess.run([*cli, "train", *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"train: {time.perf_counter() - t0:.1f}s")

    with socket.socket() as taken:  # the preferred Prefect port is in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        wanted = taken.getsockname()[1]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [*cli, "ui", "--prefect-port", str(wanted), "--mlflow-port", str(free_port())],
            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            lines = [proc.stdout.readline() for _ in range(2)]
            if not all(":" in line for line in lines):  # it exited: say why
                proc.wait(30)
                pytest.fail(f"rlstage ui printed {lines} and exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
            urls = dict(line.split(":", 1) for line in lines)
            assert set(urls) == {"Prefect UI", "MLflow UI"}, urls
            print(f"ui: {time.perf_counter() - t0:.1f}s")
            stack = tmp / "home" / "stack"
            pids = [int((stack / f"{name}.pid").read_text()) for name in ("prefect-server", "mlflow")]
            yield {
                "proc": proc, "wanted": wanted, "pids": pids,
                "prefect": urls["Prefect UI"].strip(), "mlflow": urls["MLflow UI"].strip().split("/#")[0], "mlflow_link": urls["MLflow UI"].strip(),
            }  # fmt: skip
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_runs_flow_runs_and_logs_are_in_prefect(ui):
    api = f"{ui['prefect']}/api"
    runs = httpx.post(f"{api}/flow_runs/filter", json={}).json()
    flows = {f["id"]: f["name"] for f in httpx.post(f"{api}/flows/filter", json={}).json()}
    train = [r for r in runs if flows[r["flow_id"]] == "rlstage-train"]
    assert [r["state_type"] for r in train] == ["COMPLETED"]
    assert any(flows[r["flow_id"]] == "rlstage-iteration" and r["state_type"] == "COMPLETED" for r in runs)
    logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [train[0]["id"]]}}}).json()
    assert any("Finished in state Completed" in log["message"] for log in logs), [log["message"] for log in logs]


def test_the_runs_metrics_are_in_mlflow(ui):
    api = f"{ui['mlflow']}/api/2.0/mlflow"
    exp = httpx.get(f"{api}/experiments/get-by-name", params={"experiment_name": "rlstage"}).json()["experiment"]
    found = httpx.post(
        f"{api}/runs/search",
        json={"experiment_ids": [exp["experiment_id"]], "filter": f"tags.`rlstage.run_name` = '{RUN}'"},
    ).json()["runs"]
    assert len(found) == 1
    # The printed link opens MLflow's UI on the training runs, not in its GenAI mode.
    assert ui["mlflow_link"] == f"{ui['mlflow']}/#/experiments?workflowType=machine_learning"
    metrics = {m["key"]: m for m in found[0]["data"]["metrics"]}
    assert metrics["val/accuracy"]["step"] == 1 and "critic/score/mean" in metrics


def test_a_taken_port_is_reported_and_the_ui_talks_to_the_server_it_uses(ui):
    port = int(ui["prefect"].rsplit(":", 1)[1])
    assert port != ui["wanted"]
    line = ui["proc"].stderr.readline().strip()
    assert line == f"rlstage ui: port {ui['wanted']} is taken; the Prefect UI uses port {port}"
    settings = httpx.get(f"{ui['prefect']}/ui-settings").json()
    assert settings["api_url"] == f"{ui['prefect']}/api"
    assert httpx.get(ui["prefect"]).status_code == 200  # the UI itself is served


def test_sigterm_stops_both_servers(ui):
    proc = ui["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in ui["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in ui["pids"])
    for url in (ui["prefect"], ui["mlflow"]):
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=2)


def test_a_server_whose_free_port_is_taken_before_it_binds_starts_on_another(tmp_path):
    """The race CI met once (a server exited before answering): another process binds the free port first."""

    def spawn(port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def health(port: int) -> str:
        return f"http://127.0.0.1:{port}/"

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        moves = []
        proc, port = wait_up(spawn, taken, health, 30, moved=lambda old, new: moves.append((old, new)))
        try:
            assert port != taken and moves == [(taken, port)]
            assert httpx.get(health(port)).status_code == 200
        finally:
            stop_process_group(proc)
        with pytest.raises(RuntimeError, match="exited"):  # a caller that named its port gets the failure
            wait_up(spawn, taken, health, 30)
