"""One home (``infra/home.py``): a run trained by ``rlstage train`` is seen by ``rlstage ui`` in both UIs.

First the run against a Prefect server killed mid-iteration: one line (exit 3), nothing half-visible.
Then the same command (its own Prefect server on the home, stopped at the end) finishes it, then ``rlstage ui``
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
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load

from infra.env import free_port, pid_alive
from infra.store import ArtifactStore
from schemas.config import load_config
from tasks.kit import kit_run_name
from tests_support import moving_overrides, tiny_overrides, update_weights, weights_moved

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
RUN = "seen"
STAGES = ("rollout", "reward", "advantage", "update", "eval")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI", "RLSTAGE_", "PREFECT_LOGGING_TO_API")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(RLSTAGE_HOME=str(tmp / "home"), PYTHONPATH=str(REPO))
    cli = [sys.executable, "-m", "flows.cli"]
    args = [*tiny_overrides(), *moving_overrides(), "trainer.iterations=1", f"run_name={RUN}", f"store.root={tmp / 'store'}"]
    t0 = time.perf_counter()
    lost = _stopped_by_a_lost_prefect_server([*cli, "train", *args], tmp, env)
    print(f"train, Prefect server lost: {time.perf_counter() - t0:.1f}s")
    # The same command with no server named: one on the home, started for it; committed stages reused.
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
            urls = dict(proc.stdout.readline().split(":", 1) for _ in range(2))
            assert set(urls) == {"Prefect UI", "MLflow UI"}, (urls, proc.stderr.read() if proc.poll() else "")
            print(f"ui: {time.perf_counter() - t0:.1f}s")
            stack = tmp / "home" / "stack"
            pids = [int((stack / f"{name}.pid").read_text()) for name in ("prefect-server", "mlflow")]
            yield {
                "lost": lost, "store": ArtifactStore(str(tmp / "store")),
                "proc": proc, "wanted": wanted, "pids": pids,
                "prefect": urls["Prefect UI"].strip(), "mlflow": urls["MLflow UI"].strip().split("/#")[0], "mlflow_link": urls["MLflow UI"].strip(),
            }  # fmt: skip
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _stopped_by_a_lost_prefect_server(cmd: list[str], tmp: Path, env: dict) -> dict:
    """``cmd`` against a Prefect server SIGKILLed once iteration 1's rollout is committed."""
    from infra.prefect_server import start_prefect_server
    from infra.store import ArtifactStore

    store = ArtifactStore(str(tmp / "store"))
    server = start_prefect_server(tmp / "lost-prefect")
    # Prefect's client waits about a minute per call for a server that went away (5 retries, exponential
    # backoff: a restarted server is waited for); one retry here, so the test does not wait minutes.
    lost_env = {**env, "PREFECT_API_URL": server.url, "PREFECT_CLIENT_MAX_RETRIES": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp, env=lost_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while store.manifest(RUN, 1, "rollout") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    committed = {stage: m for stage in STAGES if (m := store.manifest(RUN, 1, stage)) is not None}
    return {"rc": proc.returncode, "stderr": err, "url": server.url, "committed": committed}


def test_a_lost_prefect_server_stops_the_command_in_one_line_and_the_rerun_goes_on(ui):
    lost, store = ui["lost"], ui["store"]
    assert lost["rc"] == 3, lost["stderr"][-3000:]
    assert lost["stderr"].strip().splitlines()[-1] == (
        f"rlstage: the Prefect server {lost['url']} stopped answering during the run; "
        "committed stages are kept, rerun the command to continue"
    ), lost["stderr"][-3000:]
    assert "Traceback" not in lost["stderr"] and "Error logging to API" not in lost["stderr"]
    # Ray tasks under way may still commit (whatever their Prefect bookkeeping says); the rerun reuses all
    # that was committed, trains (the weights moved from SFT's) and everything reads back.
    assert "rollout" in lost["committed"], sorted(lost["committed"])
    assert {s: store.manifest(RUN, 1, s).artifact_id for s in lost["committed"]} == {
        s: m.artifact_id for s, m in lost["committed"].items()
    }
    sft = store.manifest(kit_run_name(load_config(None, tiny_overrides())), None, "sft")
    assert weights_moved(load(store.read_bytes(sft, "model/model.safetensors")), update_weights(store, RUN, 1))
    for stage in STAGES:
        m = store.manifest(RUN, 1, stage)
        for name in m.files:
            store.read_bytes(m, name)  # checksums, sizes


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
