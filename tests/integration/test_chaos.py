"""Chaos: a seeded schedule of SIGKILLs across the processes of a run, the command started again after each
(as a user or a nightly schedule would) until it completes; then nothing is lost or duplicated.

Kinds: the command itself and its own Prefect server (killed from outside when the command prints the line of
an iteration), a policy (trainer) worker in its update, the rollout worker while it generates, and a stage
task's process (the last three at drill points, once each); in every schedule also the command's Prefect server
during the first command's own start (held at the drill point ``prefect_server:start``). After the last run:
every committed artifact is byte-identical to an undisturbed run's (the weights moving), a reader polling the store
never saw a manifest whose files fail their checksums, each MLflow metric holds each step once, no flow run is left
Running in Prefect, and no process of the run outlives it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_prefect_lost import _servers_of, kill_at_hold

from tests_support import (
    ITERATIONS,
    Kill,
    checksums,
    cli_env,
    moving_overrides,
    orphaned_shm,
    processes_with_env,
    schedule,
    tiny_overrides,
    until_empty,
    update_weights,
    weights_moved,
)


def _drills(kills: list[Kill], markers: Path) -> list[str]:
    by_key: dict[str, list[str]] = {}
    for k in kills:
        for setting in k.drill():
            key, point = setting.split("=")
            by_key.setdefault(key, []).append(point)
    out = [f"drill.{key}=[{', '.join(repr(p) for p in points)}]" for key, points in by_key.items()]
    return [*out, f"drill.markers={markers}"] if out else out


def _poll_store(root: Path, run: str, stop: threading.Event, bad: list[str]) -> None:
    """A reader during the run: every manifest it finds has files that match their checksums."""
    from rlstage.infra.store import ArtifactCorrupt, ArtifactStore, StoreError

    store = ArtifactStore(str(root))
    while not stop.wait(0.3):
        try:
            for it in store.iterations(run):
                for stage in ("rollout", "reward", "advantage", "update", "eval"):
                    m = store.manifest(run, it, stage)
                    for name in (m.files if m is not None else ()):
                        store.read_bytes(m, name)
        except ArtifactCorrupt as err:
            bad.append(str(err))
        except (StoreError, OSError):  # a checkpoint pruned between the manifest and the read: not a torn commit
            pass


def _run_until_done(cmd, cwd: Path, env: dict, kills: list[Kill], prefect_home: Path, markers: Path, limit: int) -> tuple[list[int], list[str]]:
    """The command, started again after each death until it exits 0; the external kills fire on their lines. The
    exit codes and outputs of the attempts."""
    external = {(k.kind, k.iteration) for k in kills if k.kind in ("command", "prefect_server")}
    codes, outputs = [], []
    while len(codes) < limit:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, killed = [], False
        if not codes:  # the first command's Prefect server, killed during its own start: the command starts it again
            assert len(kill_at_hold(proc, markers, "prefect_server:start", lambda: _servers_of(prefect_home))) == 1
        for line in proc.stdout:
            out.append(line)
            for kind, it in sorted(external):
                if line.startswith(f"iteration {it:3d}:"):
                    external.discard((kind, it))
                    if kind == "command":
                        proc.kill()
                        killed = True
                    else:
                        for pid in _servers_of(prefect_home):
                            os.kill(pid, signal.SIGKILL)
            if killed:  # what it started may still hold its output open
                break
        codes.append(proc.wait(600))
        outputs.append("".join(out))
        if codes[-1] == 0:
            return codes, outputs
    pytest.fail(f"the run did not complete in {limit} attempts (exit codes {codes}):\n" + "".join(out[-60:]))


@pytest.mark.invariant("killed and continued == undisturbed", "every artifact's checksum; each MLflow step once")
@pytest.mark.parametrize("seed", [int(os.environ.get("RLSTAGE_CHAOS_SEED", "0"))])
def test_a_run_killed_at_random_is_the_run_undisturbed(seed, prefect_api, migrated_home, tmp_path):
    from rlstage.flows.training import train
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import load_config

    kills = schedule(seed, int(os.environ.get("RLSTAGE_CHAOS_KILLS", "3")))  # CI: three kills of three kinds (bench/chaos.py: more)
    print("chaos schedule:", kills)
    settings = [*tiny_overrides(), *moving_overrides(), f"trainer.iterations={ITERATIONS}", "run_name=chaos", "trainer.eval_every=1"]
    cli = [sys.executable, "-m", "rlstage.flows.cli", "train"]
    # the undisturbed run: in this process on the session's server (the command's start-up and kills are the wild
    # run's; this one only gives the checksums a run nobody disturbed commits)
    quiet = tmp_path / "quiet"
    train(config=load_config(None, [*settings, f"store.root={quiet / 'store'}", f"tracking.tracking_uri=sqlite:///{quiet / 'mlflow.db'}"]))
    wild = tmp_path / "wild"
    prefect_home = migrated_home(wild / ".rlstage")
    markers = wild / "markers"
    markers.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    drills = _drills(kills, markers)
    hold = ["drill.hold_worker_at=['prefect_server:start']", *([] if drills else [f"drill.markers={markers}"])]
    cmd = [*cli, *settings, f"store.root={wild / 'store'}", *drills, *hold]
    stop, bad = threading.Event(), []
    reader = threading.Thread(target=_poll_store, args=(wild / "store", "chaos", stop, bad), daemon=True)
    reader.start()
    try:
        codes, outputs = _run_until_done(cmd, wild, cli_env(), kills, prefect_home, markers, limit=2 + len(kills))
    finally:
        stop.set()
        reader.join(10)
    print("exit codes of the attempts:", codes)
    fired = sorted(p.name for p in markers.iterdir() if not p.name.startswith(("held-", "release-")))
    assert len(fired) == sum(bool(k.drill()) for k in kills), fired  # each drill kill fired, once
    assert codes[0] != 1  # the kill during its start was no internal error
    assert "rlstage: the Prefect server this command starts died during its start" in outputs[0], outputs[0]
    assert len(codes) >= 1 + sum(k.kind == "command" for k in kills)
    ours, theirs = ArtifactStore(str(wild / "store")), ArtifactStore(str(quiet / "store"))
    assert checksums(ours, "chaos", ITERATIONS) == checksums(theirs, "chaos", ITERATIONS)
    assert weights_moved(update_weights(ours, "chaos", 1), update_weights(ours, "chaos", ITERATIONS))
    assert not bad, bad  # no torn commit was ever visible
    with sqlite3.connect(wild / ".rlstage" / "mlflow" / "mlflow.db") as db:
        twice = db.execute("select key, step, count(*) from metrics group by run_uuid, key, step having count(*) > 1").fetchall()
        runs = db.execute("select count(distinct run_uuid) from metrics").fetchone()[0]
    assert not twice and runs == 1, twice  # one MLflow run, each metric once per step
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        running = db.execute("select name from flow_run where state_type in ('RUNNING', 'PENDING')").fetchall()
    assert not running, running  # the killed ones are Crashed, not Running forever
    # 60 s: Ray's workers run at nice 15 and get the CPU last on a loaded machine
    left = until_empty(lambda: processes_with_env(f"PREFECT_HOME={prefect_home.resolve()}"), 60)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
    left = until_empty(lambda: orphaned_shm(shm_before), 5)  # a file of a process that has just exited goes with it
    assert not left, left  # nothing the killed processes had in /dev/shm outlives them
