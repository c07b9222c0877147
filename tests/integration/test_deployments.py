"""The deployments of prefect.yaml, end to end: a real Prefect server, `prefect deploy`, a process
worker, `prefect deployment run --watch`; then the store and MLflow (the nightly continuation: test_schedule).

Everything runs in subprocesses with this test's own environment (its own server, Prefect home,
store, MLflow database and Ray temp dir): the session's `prefect_api` fixture may have exported
PREFECT_API_URL into os.environ, and nothing here reads or changes the in-process settings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rlstage.infra.env import LOOPBACK_DEFAULTS
from rlstage.schemas.stages import STAGE_FILES, spec
from tests_support import REPO

VENV_BIN = Path(sys.executable).parent
PREFECT = str(VENV_BIN / "prefect")
POOL = "rlstage-process"
RUN = "deployed"
CLI_TIMEOUT_S = 120  # one CLI call (deploy, work-pool create)
RUN_TIMEOUT_S = 150  # one `prefect deployment run --watch`
_UUID = re.compile(r"UUID: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    store: Path
    tracking_uri: str
    ray_tmp: Path
    worker_log: Path


def _stack_env(server_url: str, home: Path, ray_tmp: Path) -> dict[str, str]:
    """The test's own environment: no PREFECT_*/MLFLOW_*/RAY_* leaking in from this session."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_"))}
    env.update(LOOPBACK_DEFAULTS)
    # Left out on purpose: the deployment's job variables (prefect.yaml) must give the flow run
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, checked below from the Ray session logs.
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.update(
        PREFECT_API_URL=server_url,
        PREFECT_HOME=str(home),
        PREFECT_CLI_PROMPT="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        RAY_TMPDIR=str(ray_tmp),  # this test's Ray sessions, apart from any other Ray here
        PWD=str(REPO),  # prefect.yaml's pull step is "{{ $PWD }}", resolved by `prefect deploy`
        COLUMNS="200",  # Rich wraps the CLI's output at the terminal width
        PYTHONUNBUFFERED="1",
    )
    return env


def _cli(stack_env: dict[str, str], *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PREFECT, *args], cwd=REPO, env=stack_env, capture_output=True, text=True, timeout=timeout
    )


def _ok(proc: subprocess.CompletedProcess, what: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _groups_below(pid: int) -> list[int]:
    """Process groups of ``pid`` and its descendants (flow runs lead their own sessions)."""
    groups: list[int] = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return groups
    for p in procs:
        try:
            g = os.getpgid(p.pid)
        except ProcessLookupError:
            continue
        if g not in groups:
            groups.append(g)
    return groups


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    # an exited member not yet reaped (the worker, our child) still answers killpg: alive is a member that runs
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == group:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def _stop_groups(groups: list[int], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for g in groups:
        while _group_alive(g) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(g):
            _signal_group(g, signal.SIGKILL)


def stop_worker(worker: subprocess.Popen, grace_s: float = 15.0) -> None:
    """TERM the worker's group twice (an idle worker ignores the first), then its flow runs; KILL after grace."""
    groups = _groups_below(worker.pid)
    if worker.poll() is None:
        _signal_group(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        _signal_group(worker.pid, signal.SIGTERM)
    for g in groups:
        if g != worker.pid:
            _signal_group(g, signal.SIGTERM)
    _stop_groups(groups or [worker.pid], grace_s)
    try:
        worker.wait(5)
    except subprocess.TimeoutExpired:
        _signal_group(worker.pid, signal.SIGKILL)
        worker.wait()


def kill_leftovers(marker: str) -> list[str]:
    """Last resort: processes whose command line names this test's Ray temp dir."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(marker in part for part in p.info["cmdline"] or []):
            found.append(" ".join(p.info["cmdline"])[:120])
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory, migrated_prefect_home, migrated_mlflow_db) -> Iterator[Stack]:
    from rlstage.infra.prefect_server import start_prefect_server

    tmp = tmp_path_factory.mktemp("deployments")
    # Short: Ray's Unix socket paths under it must stay below 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlsd-", dir="/tmp"))
    worker = None
    server = None
    try:
        with pytest.MonkeyPatch.context() as mp:
            # The server subprocess takes os.environ: not the session's API URL, and no scheduler
            # (the nightly cron would otherwise queue runs; the schedule itself is checked below).
            mp.delenv("PREFECT_API_URL", raising=False)
            mp.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED", "false")
            server = start_prefect_server(migrated_prefect_home(tmp / "prefect-home"))
        env = _stack_env(server.url, server.home, ray_tmp)
        _ok(_cli(env, "work-pool", "create", POOL, "--type", "process"), "prefect work-pool create")
        worker_log = tmp / "worker.log"
        with open(worker_log, "ab") as log:
            worker = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", POOL, "--type", "process", "--install-policy", "never"],
                cwd=tmp,  # not the repo: the deployment's pull step must move the flow run there
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        store = tmp / "store"
        yield Stack(server.url, env, store, f"sqlite:///{migrated_mlflow_db(tmp / 'mlflow.db')}", ray_tmp, worker_log)
    finally:
        if worker is not None:
            stop_worker(worker)
        if server is not None:
            server.stop()
        leftovers = kill_leftovers(str(ray_tmp))
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert not leftovers, f"processes outlived the worker: {leftovers}"


@pytest.fixture(scope="module")
def deployed(stack: Stack) -> Stack:
    _ok(_cli(stack.env, "deploy", "--all", "--no-prompt"), "prefect deploy --all")
    return stack


def _client(stack: Stack):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api=stack.url)


def run_deployment(stack: Stack, name: str, params: dict) -> str:
    """`prefect deployment run NAME --watch`: its exit status gates; returns the flow run id."""
    try:
        proc = _cli(
            stack.env,
            "deployment", "run", name, "--params", json.dumps(params), "--watch",
            "--watch-timeout", str(RUN_TIMEOUT_S),
            timeout=RUN_TIMEOUT_S + 30,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish in {RUN_TIMEOUT_S}s; worker log:\n{_tail(stack.worker_log)}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-3000:]}\nworker log:\n{_tail(stack.worker_log)}"
    match = _UUID.search(out)
    assert match, out
    return match.group(1)


def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def _train_params(stack: Stack) -> dict:
    return {
        "config_path": "configs/tiny.yaml",  # relative: the flow runs in the repo (pull step)
        "overrides": [f"run_name={RUN}", f"store.root={stack.store}", f"tracking.tracking_uri={stack.tracking_uri}"],
    }


def _mlflow_run(stack: Stack):
    from mlflow.tracking import MlflowClient

    from rlstage.infra.tracking import RUN_NAME_TAG

    client = MlflowClient(stack.tracking_uri)
    exp = client.get_experiment_by_name("rlstage")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{RUN}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def _wait_task_runs(stack: Stack, name: str, count: int, timeout_s: float = 20.0) -> list:
    """Task runs reach the server through events, shortly after the flow run ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _client(stack) as client:
            runs = [t for t in client.read_task_runs(limit=200) if t.name.startswith(f"{name}-")]
        if len(runs) >= count or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def test_deployments_are_declared(deployed: Stack):
    with _client(deployed) as client:
        train = client.read_deployment_by_name("rlstage-train/train")
        nightly = client.read_deployment_by_name("rlstage-nightly/nightly")
        replay = client.read_deployment_by_name("rlstage-replay/replay")
        evaluate = client.read_deployment_by_name("rlstage-eval/eval")
        prep = client.read_deployment_by_name("rlstage-data-prep/data-prep")
    for d in (train, nightly, replay, evaluate, prep):
        assert d.work_pool_name == POOL
        assert d.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
        ], d.pull_steps
    assert train.entrypoint == "rlstage.flows.training:train"
    # The config model as a form, plus the YAML path and dotted overrides.
    props = train.parameter_openapi_schema["properties"]
    assert set(props) == {"config", "config_path", "overrides"}
    assert {"$ref": "#/definitions/RunConfig"} in props["config"]["anyOf"]
    assert "RunConfig" in train.parameter_openapi_schema["definitions"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert set(nightly.parameters) == {"run_name", "iterations"}
    assert set(replay.parameter_openapi_schema["required"]) == {"run_name", "iteration", "stage"}
    assert set(evaluate.parameter_openapi_schema["required"]) == {"run_name"}
    assert set(prep.parameter_openapi_schema["properties"]) == {"config", "config_path", "overrides"}


def test_the_train_deployment_runs_on_the_worker(deployed: Stack):
    from rlstage.infra.store import ArtifactStore

    stack = deployed
    store = ArtifactStore(str(stack.store))

    # -- the training deployment: the tiny config, 2 iterations -------------------------------
    flow_run_id = run_deployment(stack, "rlstage-train/train", _train_params(stack))
    with _client(stack) as client:
        state = client.read_flow_run(flow_run_id).state
    assert state is not None and state.type.value == "COMPLETED", state

    for it in (1, 2):
        for stage, fname in STAGE_FILES.items():
            if stage == "critic" or spec(stage).when is not None:
                continue  # the tiny config (GRPO) has no critic, no dynamic sampling
            m = store.manifest(RUN, it, stage)
            assert m is not None, f"iteration {it}: {stage} not committed"
            assert store.read_table(m, fname).num_rows > 0  # verifies the checksum
    assert store.manifest(RUN, 0, "eval") is not None
    assert store.manifest(RUN, 3, "update") is None

    # Stage tasks ran in Ray workers; they report to this server only when they inherited the
    # flow run's PREFECT_API_URL (else each would start a temporary server of its own).
    rollouts = _wait_task_runs(stack, "rollout", 2)
    assert len(rollouts) == 2 and all(t.state.type.value == "COMPLETED" for t in rollouts), rollouts

    client, run = _mlflow_run(stack)
    run_id = run.info.run_id
    for name in ("actor/pg_loss", "critic/score/mean", "timing_s/rollout", "val-core/synthetic/addition/reward/mean_at_1"):
        assert name in run.data.metrics, name
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id

    # The nightly deployment continuing a run: tests/integration/test_schedule.py (fired by its schedule, after a run the
    # CLI started) and tests/integration/test_tracking_server.py (after the training flow, against a real MLflow server).
    steps = sorted(m.step for m in client.get_metric_history(run_id, "actor/pg_loss"))
    assert steps == [1, 2]  # each iteration exactly once

    # Ray in the flow runs bound to loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 from prefect.yaml).
    raylets = sorted(stack.ray_tmp.glob("ray/session_2*/logs/raylet.out"))  # not session_latest
    assert len(raylets) == 1, raylets
    for log in raylets:
        addresses = set(re.findall(r"node_manager address: ([0-9.]+):", log.read_text(errors="replace")))
        assert addresses == {"127.0.0.1"}, (log, addresses)


def test_eval_and_data_prep_deployments(deployed: Stack):
    from rlstage.infra.store import ArtifactStore

    stack = deployed
    store = ArtifactStore(str(stack.store))
    params = _train_params(stack)
    params["overrides"] = [*params["overrides"][1:], "run_name=prepared"]
    # Both at once: the worker runs each in a process of its own, and they touch different runs.
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(run_deployment, stack, "rlstage-data-prep/data-prep", params),
            pool.submit(run_deployment, stack, "rlstage-eval/eval", {"run_name": RUN, "store_root": str(stack.store)}),
        ]
        for run in runs:
            run.result()
    prompts = store.manifest("prepared", None, "data_prep")
    assert prompts is not None and store.read_table(prompts, "test.parquet").num_rows > 0
    assert store.manifest("prepared", 1, "rollout") is None  # data prep only

    last = max(it for it in store.iterations(RUN) if store.manifest(RUN, it, "update") is not None)
    siblings = [v for v in store.versions(RUN, last, "eval") if v.startswith("eval-")]
    assert len(siblings) == 1, siblings
