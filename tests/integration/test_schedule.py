"""The nightly deployment's schedules fire: a real Prefect server with its scheduler on.

`tests/integration/test_deployments.py` runs its server with the scheduler off, so it cannot see a scheduler
that fails (Prefect 3.8.8 on SQLAlchemy 2.1 raised on every loop and created no run). Here the
nightly deployment of prefect.yaml is deployed as written (its 02:00 UTC cron) plus an interval
schedule of a few seconds; a process worker runs the first scheduled run, which must continue the
stored run (started with ``rlstage train``) by one iteration: no gap, no repeat, the same MLflow run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, LogFilter, LogFilterFlowRunId
from test_deployments import (  # the deployment test's process helpers, not copied
    POOL,
    PREFECT,
    REPO,
    RUN,
    Stack,
    _cli,
    _mlflow_run,
    _ok,
    _stack_env,
    _tail,
    _train_params,
    kill_leftovers,
    stop_worker,
)

INTERVAL_S = 10
RUN_TIMEOUT_S = 600  # for one flow run: generous, a loaded 2-core machine is several times slower
# The server's scheduler settings: look for new deployments every second, for all every 2 s.
SCHEDULER_ENV = {
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
    "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "1",
}


def _nightly_runs(client, deployment_id) -> list:

    return client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])), limit=200
    )


def _progress_logs(client, run_id, wait_s: float = 60.0) -> list[str]:
    """The flow run's log messages, all pages; logs are shipped in batches, so they may trail the final state."""
    deadline = time.monotonic() + wait_s
    while True:
        messages, offset = [], 0
        while page := client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200, offset=offset):
            messages += [g.message for g in page]
            offset += len(page)
        if any(m.startswith("iteration ") for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1.0)


def _pause(client, deployment_id, quiet_s: float = 3.0, timeout_s: float = 120.0) -> None:
    """Pause the deployment until no scheduled run is left for two checks `quiet_s` apart. Pausing deletes
    the scheduled runs, but a scheduler loop that read the deployment just before may insert its runs
    after that (the worker would then start one once the first run is done): pausing again deletes them."""
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 2:
        client.pause_deployment(deployment_id)
        time.sleep(quiet_s)
        waiting = [r for r in _nightly_runs(client, deployment_id) if r.state.type.value == "SCHEDULED"]
        quiet = 0 if waiting else quiet + 1
        assert time.monotonic() < deadline, f"scheduled runs still appear after pausing: {[r.name for r in waiting]}"


def _wait_final(client, run_id, stack: Stack):
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        state = client.read_flow_run(run_id).state
        if state.is_final() or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state.type.value == "COMPLETED", f"{state}\nworker log:\n{_tail(stack.worker_log)}"


def test_nightly_schedule_fires_and_continues_the_run(tmp_path, monkeypatch, migrated_prefect_home, migrated_mlflow_db):
    from prefect.client.orchestration import SyncPrefectClient

    from rlstage.infra.prefect_server import start_prefect_server
    from rlstage.infra.store import ArtifactStore

    ray_tmp = Path(tempfile.mkdtemp(prefix="rlss-", dir="/tmp"))  # short: Ray's socket paths
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for k, v in SCHEDULER_ENV.items():
        monkeypatch.setenv(k, v)
    server = start_prefect_server(migrated_prefect_home(tmp_path / "prefect-home"))
    worker = None
    try:
        env = {**_stack_env(server.url, server.home, ray_tmp), "PREFECT_WORKER_PREFETCH_SECONDS": "2"}
        stack = Stack(server.url, env, tmp_path / "store", f"sqlite:///{migrated_mlflow_db(tmp_path / 'mlflow.db')}", ray_tmp, tmp_path / "worker.log")
        _ok(_cli(env, "work-pool", "create", POOL, "--type", "process"), "prefect work-pool create")
        with open(stack.worker_log, "ab") as log:
            worker = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", POOL, "--type", "process", "--install-policy", "never"],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        # -- a stored run to continue: started with the CLI, one iteration (the schedule continues it:
        # one MLflow run across the two paths, checked at the end) ------------------------------
        params = _train_params(stack)
        cli = subprocess.run(
            [str(Path(sys.executable).with_name("rlstage")), "train", "-c", params["config_path"], *params["overrides"], "trainer.iterations=1"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        _ok(cli, "rlstage train")
        store = ArtifactStore(str(stack.store))
        assert store.manifest(RUN, 1, "update") is not None and store.manifest(RUN, 2, "update") is None

        # -- the nightly deployment as prefect.yaml declares it, plus an interval schedule ----------
        # Anchored now: the first interval run is due at most INTERVAL_S after the scheduler sees it.
        anchor = datetime.now(UTC).replace(microsecond=0)
        nightly_params = {"run_name": RUN, "iterations": 1, "store_root": str(stack.store)}
        _ok(
            _cli(
                env, "deploy", "-n", "nightly", "--no-prompt", "--interval", str(INTERVAL_S),
                "--anchor-date", anchor.isoformat(), "--params", json.dumps(nightly_params),
                "--concurrency-limit", "1", "--collision-strategy", "CANCEL_NEW",
            ),
            "prefect deploy -n nightly",
        )  # fmt: skip
        with SyncPrefectClient(api=server.url) as client:
            deployment = client.read_deployment_by_name("rlstage-nightly/nightly")
            assert sorted(type(s.schedule).__name__ for s in deployment.schedules) == ["CronSchedule", "IntervalSchedule"]

            # Scheduled runs appear; the first interval run leaves Scheduled when the worker takes it.
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while True:
                runs = _nightly_runs(client, deployment.id)
                started = [r for r in runs if r.state and r.state.type.value in ("PENDING", "RUNNING", "COMPLETED")]
                if started or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            # No more runs from here on: pausing deletes the scheduled runs not yet due, and runs
            # due while the first one runs are cancelled (the deployment's concurrency limit).
            _pause(client, deployment.id)
            assert started, f"no scheduled run started; server log:\n{_tail(server.home / 'server.log')}"
            assert len(started) == 1, [(r.name, r.state.name) for r in started]
            scheduled = [r for r in runs if r.auto_scheduled]
            assert all(r.auto_scheduled for r in started)
            times = sorted(r.expected_start_time for r in scheduled)
            # The cron's next 02:00 UTC, and interval runs every INTERVAL_S from the anchor.
            now = datetime.now(UTC)
            next_2am = now.replace(hour=2, minute=0, second=0, microsecond=0)
            next_2am += timedelta(days=1) if next_2am <= now else timedelta(0)
            assert next_2am in times, (next_2am, times)
            cron = sorted({t for t in times if (t.hour, t.minute, t.second) == (2, 0, 0)})
            assert {(b - a).total_seconds() for a, b in zip(cron, cron[1:], strict=False)} <= {86400.0}, cron
            interval = list(times)
            for t in cron:  # one run each (an interval run may fall on 02:00:00 as well)
                interval.remove(t)
            steps = {(b - a).total_seconds() for a, b in zip(interval, interval[1:], strict=False)}
            assert steps == {float(INTERVAL_S)}, times
            assert all((t - anchor).total_seconds() % INTERVAL_S == 0 for t in times if t < next_2am)

            # The first scheduled run completes.
            run_id = started[0].id
            _wait_final(client, run_id, stack)
            # Named after the run and its iteration, with its progress in the flow run's logs.
            assert client.read_flow_run(run_id).name == f"{RUN} iteration 2"
            logs = _progress_logs(client, run_id)
            assert any(m.startswith("iteration   2: train reward") for m in logs), logs
            others = [r for r in _nightly_runs(client, deployment.id) if r.id != run_id]
            ran = [(r.name, r.state.name, r.run_count) for r in others if r.state.type.value != "CANCELLED" or r.run_count]
            assert not ran, ran

        # It continued the run: iteration 2 sampled from iteration 1's update, nothing repeated.
        assert store.manifest(RUN, 2, "update") is not None
        assert store.manifest(RUN, 3, "update") is None
        assert store.manifest(RUN, 2, "rollout").inputs["policy"] == store.manifest(RUN, 1, "update").artifact_id
        mlflow, run = _mlflow_run(stack)
        assert run.data.tags["prefect.flow_run_id"] == str(run_id)
        assert sorted(m.step for m in mlflow.get_metric_history(run.info.run_id, "actor/pg_loss")) == [1, 2]
        assert "Unexpected error" not in (server.home / "server.log").read_text(errors="replace")
    finally:
        if worker is not None:
            stop_worker(worker)
        server.stop()
        leftovers = kill_leftovers(str(ray_tmp))
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not leftovers, f"processes outlived the worker: {leftovers}"
