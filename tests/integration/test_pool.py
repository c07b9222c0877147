"""Warm role workers (workers/pool.py): a released run's worker serves the next compatible run of this process,
with artifacts equal to a fresh worker's; another build gets a fresh worker; idle workers are stopped."""

from __future__ import annotations

import time

import pytest
import ray

from rlstage.schemas.config import load_config
from rlstage.workers import pool
from tests_support import (
    REPO,
    checksums,
    moving_overrides,
    tiny_config,
    tiny_overrides,
    update_weights,
    weights_moved,
)

TRAINED = ("rollout", "reward", "advantage", "update")  # the stages a worker computes


def _trained_on(cfg, run: str, iteration: int = 1) -> int:
    from rlstage.tasks.runtime import store_for

    return store_for(cfg).manifest(run, iteration, "update").meta["trained_on"][0]["pid"]


@pytest.mark.invariant("warm worker == fresh worker", "every artifact's checksum")
def test_a_released_worker_serves_the_next_run_with_a_fresh_workers_artifacts(prefect_api, tmp_path, monkeypatch):
    """The second of two runs alike takes the first one's worker and commits the same bytes; another engine
    setting, then other code, each get a fresh worker."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    pool.make_room()  # nothing idle from other tests: the first run starts a fresh worker
    fresh = tiny_config(tmp_path / "fresh", "w")
    train(config=fresh)
    assert pool.idle_count() == 1  # released into the pool, not stopped
    warm = tiny_config(tmp_path / "warm", "w")
    train(config=warm)
    pid = _trained_on(fresh, "w")
    assert _trained_on(warm, "w") == pid  # the same process served the second run
    store = store_for(warm)
    assert weights_moved(update_weights(store, "w", 2), update_weights(store, "w", 1))
    assert checksums(store_for(warm), "w", 2, TRAINED) == checksums(store_for(fresh), "w", 2, TRAINED)  # byte for byte a fresh worker's
    # a run of another engine build gets a fresh worker, and the idle one is stopped for its resources
    other = tiny_config(tmp_path / "other", "w", "rollout.vllm.max_num_seqs=8", "trainer.iterations=1")
    train(config=other)
    assert _trained_on(other, "w") != pid
    assert pool.idle_count() == 1
    # the same build from other code (an edited module on the cluster's nodes): a fresh worker again
    monkeypatch.setattr(pool, "code_version", lambda: "edited")
    edited = tiny_config(tmp_path / "edited", "w", "rollout.vllm.max_num_seqs=8", "trainer.iterations=1")
    train(config=edited)
    assert _trained_on(edited, "w") not in (pid, _trained_on(other, "w"))


def test_the_key_holds_the_model_the_engines_and_the_resources():
    base = load_config(None, ["run_name=k"])
    key = pool.worker_key(base, "trainer", {"num_cpus": 1})
    assert pool.worker_key(load_config(None, ["run_name=other", "store.root=/elsewhere"]), "trainer", {"num_cpus": 1}) == key
    for change in ("model.path=/some/model", "model.dtype=bfloat16", "rollout.engine=vllm", "actor.engine=deepspeed", "rollout.vllm.max_num_seqs=8"):
        assert pool.worker_key(load_config(None, ["run_name=k", change]), "trainer", {"num_cpus": 1}) != key, change
    # what each run gives the worker as it binds it (batches, seeds, LoRA, the loss) leaves the build alone
    for change in ("rollout.batch_size=32", "model.lora_rank=4", "trainer.seed=3", "actor.optim.lr=0.5"):
        assert pool.worker_key(load_config(None, ["run_name=k", change]), "trainer", {"num_cpus": 1}) == key, change
    assert pool.worker_key(base, "trainer", {"num_cpus": 2}) != key
    assert pool.worker_key(base, "rollout", {"num_cpus": 1}) != key


def test_released_data_parallel_ranks_serve_the_next_group_with_a_fresh_groups_artifacts(prefect_api, tmp_path):
    """Two ZeRO-2 ranks released by one run form the next run's group (a new process group, each rank's optimizer
    partition its own) and commit a fresh group's bytes; one of them then trains a run of world size 1 alone."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    world2 = ["ray.trainer_world_size=2", "ray.worker_num_cpus=0.5", "actor.engine=deepspeed", "actor.zero_stage=2"]
    pool.make_room()
    fresh = tiny_config(tmp_path / "fresh", "dp", *world2)
    train(config=fresh)
    assert pool.idle_count() == 2

    def ranks(cfg, it=1):
        return sorted(r["pid"] for r in store_for(cfg).manifest("dp", it, "update").meta["trained_on"])

    warm = tiny_config(tmp_path / "warm", "dp", *world2)
    train(config=warm)
    assert ranks(warm) == ranks(fresh) and len(set(ranks(fresh))) == 2  # the same two processes
    sums = checksums(store_for(warm), "dp", 2, TRAINED)
    assert {f"{k}/update/trainer_state/rank-{r}/trainer_state.safetensors" for k in (1, 2) for r in (0, 1)} <= set(sums)
    assert sums == checksums(store_for(fresh), "dp", 2, TRAINED)  # byte for byte a fresh group's
    store = store_for(warm)
    assert weights_moved(update_weights(store, "dp", 2), update_weights(store, "dp", 1))
    alone = tiny_config(tmp_path / "alone", "dp", *world2[1:], "trainer.iterations=1")  # world size 1, the same build
    train(config=alone)
    assert ranks(alone)[0] in ranks(fresh)
    # ...as world size 2 trains (its process group left: no all-reduce waits for a rank that is gone)
    one, two = update_weights(store_for(alone), "dp", 1), update_weights(store_for(fresh), "dp", 1)
    assert max((one[k] - two[k]).abs().max().item() for k in two) < 1e-5


def test_drills_keep_cold_workers():
    assert pool.poolable(load_config(None, ["run_name=k"]))
    assert pool.poolable(load_config(None, ["run_name=k", "ray.trainer_world_size=2"]))
    assert not pool.poolable(load_config(None, ["run_name=k", "ray.warm_worker_idle_s=0"]))
    assert not pool.poolable(load_config(None, ["run_name=k", "drill.kill_worker_at=['update:1']"]))
    assert not pool.poolable(load_config(None, ["run_name=k", "rollout.engine=vllm"]))


def test_a_worker_busy_in_a_run_is_never_taken_and_idle_ones_are_stopped(prefect_api, tmp_path, monkeypatch, capsys):
    from rlstage.infra.ray_runtime import ensure_ray
    from rlstage.workers.group import open_group

    monkeypatch.setenv("RLSTAGE_VERBOSE", "1")  # --verbose: the pool says why a group starts a fresh worker
    a, b = tiny_config(tmp_path, "busy-a", "ray.warm_worker_idle_s=1"), tiny_config(tmp_path, "busy-b", "ray.warm_worker_idle_s=1")
    ensure_ray(a)
    pool.make_room()
    first = open_group(a)
    second = open_group(b)  # while the first is held: a worker of its own
    pids = {ray.get(first.ranks[0].pid.remote()), ray.get(second.ranks[0].pid.remote())}
    assert len(pids) == 2
    assert "policy-busy-b-" in (said := capsys.readouterr().err) and "starts a fresh trainer worker: 1 worker(s) of its build are busy in other runs" in said, said
    first.release()
    second.release()
    assert pool.idle_count() == 2
    deadline = time.monotonic() + 60
    while pool.idle_count() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool.idle_count() == 0  # ray.warm_worker_idle_s after their release


def test_the_stacks_cluster_keeps_a_released_worker_for_the_next_command(migrated_home, tmp_path):
    """Commands on a home where ``infra/stack.sh up`` runs join its Ray head: a command's released worker waits
    there, detached, and the next command of its build trains with it, to a fresh worker's bytes. A command SIGKILLed
    while it holds that worker leaves it bound to a dead run; the next command stops it and trains on a fresh one,
    again to the same bytes. ``infra/stack.sh down`` stops the idle worker with the cluster."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from rlstage.infra.env import free_port, pid_alive
    from rlstage.infra.store import ArtifactStore
    from tests_support import cli_env, start_cli_until

    home = tmp_path / "home"
    migrated_home(home)
    ports = {f"RLSTAGE_{name}_PORT": str(free_port()) for name in ("PREFECT", "MLFLOW", "RAY")}
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # the stack's Ray sessions apart from /tmp/ray (short: sockets)
    env = cli_env(RLSTAGE_HOME=str(home), PREFECT_UI_ENABLED="false", RAY_TMPDIR=ray_tmp, **ports)
    stack = [str(REPO / "infra" / "stack.sh")]

    def command(store: str) -> list[str]:
        # 3 iterations: the kill on iteration 1's line lands while two more hold the worker (its release comes last)
        overrides = [*tiny_overrides(), *moving_overrides(), "trainer.iterations=3", "run_name=w", f"store.root={tmp_path / store}"]
        return [sys.executable, "-m", "rlstage.flows.cli", "--verbose", "train", *overrides]

    def run(store: str) -> str:
        done = subprocess.run(command(store), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return done.stderr

    def trained_on(store: str, iteration: int = 1) -> int:
        return ArtifactStore(str(tmp_path / store)).manifest("w", iteration, "update").meta["trained_on"][0]["pid"]

    def sums(store: str, iterations: tuple[int, ...] = (1, 2, 3)) -> dict[str, str]:
        st = ArtifactStore(str(tmp_path / store))
        return {f"{it}/{s}/{n}": e.sha256 for it in iterations for s in ("rollout", "reward", "advantage", "update") for n, e in st.manifest("w", it, s).files.items()}

    up = subprocess.run(["bash", *stack, "up"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
        assert f"ray head:       127.0.0.1:{ports['RLSTAGE_RAY_PORT']}" in up.stdout
        said = run("first")
        assert "starts a fresh trainer worker: no idle worker on the cluster" in said, said[-3000:]
        pid = trained_on("first")
        assert pid_alive(pid)  # detached: it outlived its command

        proc = start_cli_until(command("killed"), tmp_path, env, "iteration   1:")
        proc.kill()  # while it holds the worker, bound to its run
        rest = proc.communicate(timeout=60)[0]
        assert trained_on("killed") == pid, rest[-3000:]  # the next command took the released worker...
        assert sums("killed", (1,)) == sums("first", (1,))  # ...and committed a fresh worker's bytes
        assert pid_alive(pid)  # bound to a run nobody continues, holding its CPU

        said = run("after")
        assert "stopped 1 warm worker(s) of a command that ended without releasing them" in said, said[-3000:]
        fresh = trained_on("after")
        assert fresh != pid and not pid_alive(pid)
        assert sums("after") == sums("first")
        store = ArtifactStore(str(tmp_path / "after"))
        assert weights_moved(update_weights(store, "w", 1), update_weights(store, "w", 3))
        assert pid_alive(fresh)  # released, idle on the stack's cluster
    finally:
        down = subprocess.run(["bash", *stack, "down"], env=env, capture_output=True, text=True, timeout=300)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert down.returncode == 0, down.stderr[-2000:]
    assert not pid_alive(fresh)  # stopped with the cluster
