"""A command whose Prefect server stops answering mid-run says so in one line (flows/cli.py: PrefectLost, exit 3).

With Prefect's default client retries that takes ~3.5 minutes (measured by hand); the drill below sets one retry.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests_support import (
    cli_env,
    moving_overrides,
    processes_with_env,
    start_cli_until,
    tiny_overrides,
    until_empty,
    update_weights,
    weights_moved,
)


def _servers_of(prefect_home: Path) -> dict[int, bytes]:
    """The Prefect API servers on ``prefect_home``: pid -> command line (``prefect server start``, and the uvicorn
    of the ephemeral server Prefect's client starts where its settings name no API)."""
    home = f"PREFECT_HOME={prefect_home.resolve()}"
    cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in processes_with_env(home)}
    return {p: c for p, c in cmdlines.items() if b"prefect\0server\0start" in c or b"prefect.server.api.server:create_app" in c}


def test_a_lost_server_is_one_line_and_the_rerun_heals_its_own(migrated_prefect_home, migrated_home, tmp_path):
    """A server the command did not start (PREFECT_API_URL), SIGKILLed once the SFT is committed: the command
    stops with one line (exit 3, no traceback, nothing half-written). The same command again, now on a server it
    starts itself: SIGKILL that one too; within seconds the command starts it again on the same home and port
    (one line), trains on from the kept SFT, and the flow run that lived through it ends Completed."""
    from safetensors.torch import load

    from rlstage.infra.prefect_server import start_prefect_server
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import load_config
    from rlstage.schemas.stages import kit_run_name

    theirs = migrated_prefect_home(tmp_path / "their-prefect")
    ours = migrated_home(tmp_path / ".rlstage")  # the command's own home
    server = start_prefect_server(theirs)
    env = cli_env(PREFECT_API_URL=server.url, PREFECT_CLIENT_MAX_RETRIES="1")
    overrides = [
        *tiny_overrides(),
        *moving_overrides(),
        "run_name=lost",
        f"store.root={tmp_path / 'store'}",
        "trainer.iterations=1",
    ]
    cmd = [sys.executable, "-m", "rlstage.flows.cli", "train", *overrides]
    try:
        proc = start_cli_until(cmd, tmp_path, env, "iteration   0:")  # the SFT checkpoint is committed and evaluated
        try:
            server.proc.kill()
            rest = proc.stdout.read()
            assert proc.wait(300) == 3, rest
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        server.stop()
    assert "Traceback" not in rest and "| ERROR" not in rest, rest  # Prefect's lines stay in the UI (--verbose prints them)
    last = rest.strip().splitlines()[-1]
    assert last.endswith("stopped answering during the run; committed stages are kept, rerun the command to continue")
    store = ArtifactStore(str(tmp_path / "store"))
    cfg = load_config(None, overrides)
    sft = store.manifest(kit_run_name(cfg), None, "sft")
    # stopped after the SFT, before the update (nothing of iteration 1 half-written is visible)
    assert sft is not None and store.manifest("lost", 1, "update") is None

    # The same command on its own server (no PREFECT_API_URL): what it started, it heals. Its trainer holds in
    # update 1 until the restart is said (a tiny iteration takes ~1 s: a kill could come after the run's end).
    env, markers = cli_env(), tmp_path / "markers"
    markers.mkdir()
    held = [*cmd, "drill.hold_worker_at=['update:1']", f"drill.markers={markers}"]
    proc = start_cli_until(held, tmp_path, env, "iteration   0:")
    try:
        until_empty(lambda: not ((markers / "held-update-1").exists() or proc.poll() is not None), 300)
        assert proc.poll() is None, proc.stdout.read()
        (pid, cmdline), *more = _servers_of(ours).items()
        assert not more, more  # the command's clients talk to the server it started, and to no other
        port = cmdline.split(b"--port\0")[1].split(b"\0")[0].decode()
        os.kill(pid, signal.SIGKILL)
        lines = []
        for out in proc.stdout:
            lines.append(out)
            if "started again" in out:
                (markers / "release-update-1").touch()
        rest = "".join(lines)
        assert proc.wait(300) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    line = f"rlstage: the Prefect server this command started stopped; started again on port {port} (restart 1 of 3)"
    assert line in rest.splitlines(), rest
    assert "Traceback" not in rest and "| ERROR" not in rest and "learning:" in rest, rest
    assert not _servers_of(ours), "the restarted server outlived the command"
    assert store.manifest(kit_run_name(cfg), None, "sft").artifact_id == sft.artifact_id  # reused, not redone
    start = load(store.read_bytes(sft, "model/model.safetensors"))
    assert weights_moved(start, update_weights(store, "lost", 1))  # it trained on from the kept SFT
    with sqlite3.connect(ours / "prefect.db") as db:  # the flow run that lived through the restart
        states = db.execute("select state_type from flow_run where name = 'lost iteration 1'").fetchall()
    assert states == [("COMPLETED",)]


def _rays_of(prefect_home: Path) -> dict[int, bytes]:
    """The Ray processes a command with this Prefect home started (they inherit its environment)."""
    home = f"PREFECT_HOME={prefect_home.resolve()}"
    cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in processes_with_env(home)}
    return {p: c for p, c in cmdlines.items() if b"raylet" in c or b"gcs_server" in c or c.startswith(b"ray::")}


def test_a_ray_and_a_prefect_server_killed_while_starting_or_running_are_started_again(migrated_home, tmp_path):
    """One command, three kills. Its local Ray and its Prefect server, each SIGKILLed during its own start (held at
    the drill points ``ray:start`` and ``prefect_server:start``, before the command has used either): each is started
    again, said in one line (before: "internal error: RuntimeError: server for http://127.0.0.1:.../api/health exited
    with code -9", rc 1, or Ray's "timed out during startup" after 30 s). Then the raylet, SIGKILLed while the trainer
    holds in update 1: the command says so in one line, starts Ray again and trains on from the committed stages to
    the end (exit 0), with the weights moving; no Ray or server process outlives it, and the flow run completed.
    (Killed on the iteration-0 line instead, a CI run once found the command already done: a tiny iteration takes
    ~1 s.)"""
    from safetensors.torch import load

    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import load_config
    from rlstage.schemas.stages import kit_run_name

    ours = migrated_home(tmp_path / ".rlstage")
    markers = tmp_path / "markers"
    markers.mkdir()
    overrides = [
        *tiny_overrides(), *moving_overrides(), "run_name=raylost", f"store.root={tmp_path / 'store'}", "trainer.iterations=1",
        "drill.hold_worker_at=['ray:start', 'prefect_server:start', 'update:1']", f"drill.markers={markers}",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "rlstage.flows.cli", "train", *overrides]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        raylet = lambda: [p for p, c in _rays_of(ours).items() if c.split(b"\0")[0].endswith(b"/raylet")]  # noqa: E731
        assert len(kill_at_hold(proc, markers, "ray:start", raylet)) == 1
        assert len(kill_at_hold(proc, markers, "prefect_server:start", lambda: _servers_of(ours))) == 1
        until_empty(lambda: not ((markers / "held-update-1").exists() or proc.poll() is not None), 300)
        assert proc.poll() is None, proc.stdout.read()
        raylets = [p for p, c in _rays_of(ours).items() if b"raylet" in c.split(b"\0")[0]]
        assert len(raylets) == 1, _rays_of(ours)
        os.kill(raylets[0], signal.SIGKILL)
        t0, lines, noticed = time.monotonic(), [], None
        for out in proc.stdout:  # when the command says it (printed, not asserted: a slow machine is no failure)
            lines.append(out)
            if noticed is None and "started again" in out:
                noticed = time.monotonic() - t0
                (markers / "release-update-1").touch()  # the rerun's trainer holds at the same point until now
        rest = "".join(lines)
        print(f"said {noticed} s after the kill, ended {time.monotonic() - t0:.1f} s after it")
        assert proc.wait(300) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    said = [line for line in rest.splitlines() if "during its start" in line]
    assert len(said) == 2, rest
    assert said[0] == "rlstage: the local Ray this command starts died during its start (its raylet exited); starting it again (try 2 of 3)"
    assert re.fullmatch(
        r"rlstage: the Prefect server this command starts died during its start \(server for http://127\.0\.0\.1:\d+/api/health "
        r"exited with code -9\); starting it again \(try 2 of 3\)", said[1]
    ), rest
    line = "rlstage: the local Ray this command started died; started again (restart 1 of 3), the run goes on from its committed stages"
    assert line in rest.splitlines(), rest
    assert "internal error" not in rest, rest
    assert "Traceback" not in rest and "learning:" in rest
    # neither Prefect's ERROR lines nor Ray's report of the dead node (its state dump): the line above says it
    assert "| ERROR" not in rest and "(raylet)" not in rest and "[state-dump]" not in rest, rest
    store = ArtifactStore(str(tmp_path / "store"))
    sft = store.manifest(kit_run_name(load_config(None, overrides)), None, "sft")
    start = load(store.read_bytes(sft, "model/model.safetensors"))
    assert weights_moved(start, update_weights(store, "raylost", 1))  # it trained on, to the last iteration
    for _ in range(100):  # processes that got their signal may take a moment to exit
        if not _rays_of(ours):
            break
        threading.Event().wait(0.2)
    assert not _rays_of(ours), "a Ray process outlived the command"
    assert not until_empty(lambda: _servers_of(ours), 60), "a server outlived the command"
    with sqlite3.connect(ours / "prefect.db") as db:
        states = db.execute("select state_type from flow_run where name = 'raylost iteration 1'").fetchall()
    assert ("COMPLETED",) in states, states


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def kill_at_hold(proc, markers: Path, point: str, pids) -> list[int]:
    """Wait until the command ``proc`` holds at drill point ``point``, SIGKILL ``pids()`` there, and once they have
    exited release the hold; the pids killed. The kill lands at that point whatever the machine's speed."""
    name = point.replace(":", "-")
    until_empty(lambda: not ((markers / f"held-{name}").exists() or proc.poll() is not None), 300)
    assert proc.poll() is None, proc.stdout.read()
    killed = list(pids())
    assert killed, f"nothing to kill at {point}"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    assert not until_empty(lambda: [p for p in killed if not _gone(p)], 30)
    (markers / f"release-{name}").touch()
    return killed


def test_a_lost_cluster_it_joined_is_one_line_within_seconds(migrated_home, tmp_path):
    """A Ray cluster the command did not start (`ray start` elsewhere, token authentication as Ray's default,
    joined with ``ray.address`` and a relative ``store.root``), SIGKILLed while the trainer holds in update 2:
    the command stops with one line (exit 3) long before Ray's driver would give up on its GCS (60 s, then an
    exit without a word), iteration 1 is committed under the command's own directory, not the cluster's."""
    import subprocess
    import tempfile

    from rlstage.infra.env import free_port
    from rlstage.infra.store import ArtifactStore

    port, token = free_port(), os.urandom(16).hex()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    cluster_dir, user_dir, markers = tmp_path / "cluster", tmp_path / "user", tmp_path / "markers"
    for d in (cluster_dir, user_dir, markers):
        d.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # Ray's socket paths must stay short
    mark = f"RLSTAGE_TEST_CLUSTER={ray_tmp}"
    head = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}", "--num-cpus=2",
        "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={ray_tmp}", "--disable-usage-stats",
    ]  # fmt: skip
    env = {**cli_env(), **auth, "RLSTAGE_TEST_CLUSTER": ray_tmp}
    started = subprocess.run(head, cwd=cluster_dir, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-2000:]
    migrated_home(user_dir / ".rlstage")
    overrides = [
        *tiny_overrides(), *moving_overrides(), "run_name=joined", "store.root=./store", f"ray.address=127.0.0.1:{port}",
        "drill.hold_worker_at=['update:2']", f"drill.markers={markers}",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "rlstage.flows.cli", "train", *overrides]
    try:
        proc = start_cli_until(cmd, user_dir, {**cli_env(), **auth}, "iteration   1:")
        try:
            for _ in range(600):
                if (markers / "held-update-2").exists() or proc.poll() is not None:
                    break
                time.sleep(0.2)
            assert proc.poll() is None, proc.stdout.read()
            t0 = time.monotonic()
            for pid in processes_with_env(mark):  # the whole cluster: its GCS, raylet and workers
                os.kill(pid, signal.SIGKILL)
            rest = proc.stdout.read()
            assert proc.wait(120) == 3, rest
            print(f"said {time.monotonic() - t0:.1f} s after the kill")  # printed, not asserted: a slow machine is no failure
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        for pid in processes_with_env(mark):
            os.kill(pid, signal.SIGKILL)
    line = (
        f"rlstage: the Ray cluster at 127.0.0.1:{port} stopped answering during the run; committed stages are kept, "
        "rerun the command to continue"
    )
    assert rest.strip().splitlines() == [line], rest  # no Prefect ERROR lines, no Ray report of the dead GCS
    store = ArtifactStore(str(user_dir / "store"))
    assert store.manifest("joined", 1, "update") is not None and store.manifest("joined", 2, "update") is None
    assert not (cluster_dir / "store").exists()
