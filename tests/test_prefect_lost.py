"""The Prefect server killed mid-run: the command stops with one line (exit 3), no stage is half-visible,
and the next invocation (here on another server) reuses every committed stage and goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import moving_overrides, tiny_overrides, update_weights, weights_moved

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
RUN = "lost"


def test_a_prefect_server_lost_mid_run_stops_with_one_line_and_the_rerun_goes_on(tmp_path):
    from infra.prefect_server import start_prefect_server
    from infra.store import ArtifactStore

    drop = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI", "RLSTAGE_", "PREFECT_LOGGING_TO_API")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(RLSTAGE_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    store = ArtifactStore(str(tmp_path / "store"))
    cmd = [
        sys.executable, "-m", "flows.cli", "train", *tiny_overrides(), *moving_overrides(), "trainer.iterations=2",
        f"run_name={RUN}", f"store.root={store.root}",
    ]  # fmt: skip

    server = start_prefect_server(tmp_path / "prefect")
    # Prefect's client waits about a minute per call for a server that went away (5 retries, exponential
    # backoff: a restarted server is waited for); one retry here, so the test does not wait minutes.
    lost_env = {**env, "PREFECT_API_URL": server.url, "PREFECT_CLIENT_MAX_RETRIES": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=lost_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while store.manifest(RUN, 1, "rollout") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its workers, mid-iteration
        server.proc.wait()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"rlstage: the Prefect server {server.url} stopped answering during the run; "
        "committed stages are kept, rerun the command to continue"
    ), err[-3000:]
    assert "Traceback" not in err and "Error logging to API" not in err
    assert store.manifest(RUN, 2, "update") is None  # it stopped
    rollout = store.manifest(RUN, 1, "rollout")

    # Again, with no server named: the command starts one on its home; what was committed is reused.
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert store.manifest(RUN, 1, "rollout").artifact_id == rollout.artifact_id
    assert store.manifest(RUN, 2, "update") is not None
    assert weights_moved(update_weights(store, RUN, 1), update_weights(store, RUN, 2))
    for it in (1, 2):  # every committed artifact reads back: checksums, sizes, rows
        for stage in ("rollout", "reward", "advantage", "update"):
            m = store.manifest(RUN, it, stage)
            for name in m.files:
                store.read_bytes(m, name)
