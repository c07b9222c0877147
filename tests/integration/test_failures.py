"""Killed workers: a SIGKILLed stage process (before or inside its commit) is retried to byte-identical
artifacts; a killed flow, rerun, executes no committed stage again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests_support import (
    checksums,
    iteration_stages,
    moving_overrides,
    tiny_config,
    tiny_overrides,
    update_weights,
    weights_moved,
)

# Every registry stage of a default iteration without a critic (the critic stage needs a critic input). They run
# on Ray; data prep and SFT run in the flow's process, which the flow drill below kills instead.
STAGES = iteration_stages()


@pytest.fixture(scope="module")
def reference(prefect_api, tmp_path_factory):
    """An uninterrupted run of the settings every drill below uses (weights moving every iteration)."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    cfg = tiny_config(tmp_path_factory.mktemp("reference"), "r")
    train(config=cfg)
    return store_for(cfg)


@pytest.mark.invariant("killed and continued == undisturbed", "every artifact's checksum")
def test_sigkill_of_each_stage_process_is_retried_to_identical_artifacts(reference, tmp_path):
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    markers = tmp_path / "markers"
    markers.mkdir()
    # every stage of iteration 1 is killed once, after computing and before committing; in iteration 2 a stage
    # task and the policy worker are killed inside their commits, between the data files and the manifest
    kill_at = "[" + ",".join(f"'{s}:1'" for s in STAGES) + "]"
    in_commit = "drill.kill_in_commit=['advantage:2','update:2']"
    killed = tiny_config(tmp_path / "killed", "r", f"drill.kill_at={kill_at}", in_commit, f"drill.markers={markers}")
    result = train(config=killed)
    fired = sorted(p.name for p in markers.iterdir())
    assert fired == sorted([*(f"kill_at-{s}-1" for s in STAGES), "kill_in_commit-advantage-2", "kill_in_commit-update-2"])
    assert [h["iteration"] for h in result["history"]] == [0, 1, 2]
    assert checksums(store_for(killed), "r", 2) == checksums(reference, "r", 2)
    store = store_for(killed)
    assert weights_moved(update_weights(store, "r", 1), update_weights(store, "r", 2))
    assert STAGES == ("rollout", "reward", "advantage", "update", "eval")


def test_killed_flow_reruns_no_committed_stage(reference, tmp_path):
    """SIGKILL of the flow's own process mid-iteration: the rerun executes no committed stage again, ends
    with an uninterrupted run's checksums, and the killed flow run shows as Crashed in Prefect."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    root = tmp_path / "store"
    markers = tmp_path / "markers"
    markers.mkdir()
    script = (
        "import sys\n"
        "from rlstage.schemas.config import RunConfig, load_config\n"
        "from rlstage.flows.training import train\n"
        "if __name__ == '__main__':\n"
        "    train(config=load_config(None, sys.argv[1:]))\n"
    )
    overrides = [f"store.root={root}", "run_name=r", *tiny_overrides(), *moving_overrides()]
    drill = ["drill.kill_flow_after=['advantage:1']", f"drill.markers={markers}"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *overrides, *drill], env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # the whole flow process was SIGKILLed
    rerun = train(config=tiny_config(root, "r"))
    assert rerun["executed"][:2] == ["iter-1/update", "iter-1/eval"]
    assert not any(s in rerun["executed"] for s in ("data_prep", "sft", "iter-0/eval", "iter-1/rollout"))
    assert not any(s in rerun["executed"] for s in ("iter-1/reward", "iter-1/advantage"))
    store = store_for(tiny_config(root, "r"))
    assert checksums(store, "r", 2) == checksums(reference, "r", 2)
    assert weights_moved(update_weights(store, "r", 1), update_weights(store, "r", 2))
    # Prefect: the killed flow run and its iteration subflow crashed; the rerun completed.
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["r iterations 1-2", "r-iter-1"])))
    mine = [r for r in runs if r.state is not None and (r.state.is_crashed() or r.state.is_completed())]
    by_name = {n: sorted(r.state.type.value for r in mine if r.name == n) for n in ("r iterations 1-2", "r-iter-1")}
    assert by_name["r iterations 1-2"].count("CRASHED") >= 1 and by_name["r-iter-1"].count("CRASHED") >= 1, by_name
    assert not [r for r in runs if r.state is not None and r.state.is_running()], [(r.name, r.state.type) for r in runs]
