"""Worker groups in the pipeline: data-parallel trainer ranks, checkpoints that never cross Ray as
bytes, placements the cluster cannot hold refused before any stage."""

from __future__ import annotations

import glob
import os
import time

import pytest
from safetensors.torch import load as load_safetensors

from rlstage.schemas.config import ConfigError, load_config
from rlstage.workers.policy import scratch_root
from rlstage.workers.roles import Trainer
from tests_support import (
    checksums,
    iteration_stages,
    moving_overrides,
    source_path,
    tiny_config,
    tiny_overrides,
    update_weights,
    weights_moved,
)


# The pipeline runs a per-sequence mode over token-budget micro-batches on ZeRO-3 and the torch engine, and
# token-mean with fixed-count micro-batches on ZeRO-2. Every aggregation mode at world size 2, ZeRO-0 included,
# is checked at the engine level (test_actor_deepspeed: data parallel).
@pytest.mark.invariant("data-parallel world 2 == world 1", "the stored policy within 1e-5, the samples equal")
@pytest.mark.parametrize(
    "mode,budget,engines",
    [("seq-mean-token-mean", 24, (("deepspeed", 3), ("torch", 0))), ("token-mean", None, (("deepspeed", 2),))],
    ids=["seq-mean-token-mean+token-budget", "token-mean"],
)
def test_two_trainer_ranks_train_the_policy_one_rank_does(prefect_api, tmp_path, mode, budget, engines):
    """World size 2 (two Ray actors over gloo: DeepSpeed ZeRO-2 and 3, and the torch engine's all-reduce)
    gives world size 1's (torch engine) policy; under ZeRO 1-3 each rank stores its own optimizer partition.
    Both ranks generate a share of the rollout (its two HF batches) where each holds the whole policy (not ZeRO-3),
    and the samples are one rank's."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    common = ["trainer.iterations=1", f"actor.loss_agg_mode={mode}", "actor.ppo_epochs=2", "rollout.batch_size=16"]
    if budget:
        common += [f"actor.micro_batch_tokens={budget}", "data.max_prompt_length=16"]
    one = tiny_config(tmp_path, "dp1", *common)
    train(config=one)
    assert train(config=one)["history"][-1]["executed"] == []  # rerun: every stage committed, nothing executes
    store = store_for(one)
    w1 = update_weights(store, "dp1", 1)
    samples = store.read_table(store.manifest("dp1", 1, "rollout"), "rollouts.parquet").column("response_ids")
    results = {}
    for engine, zero in engines:
        run = f"dp2-{engine}-{zero}"
        two = tiny_config(tmp_path, run, *common, "ray.trainer_world_size=2", "ray.worker_num_cpus=0.5", f"actor.engine={engine}", f"actor.zero_stage={zero}")
        results[engine, zero] = train(config=two)
        shards = sorted({n.split("/")[1] for n in store.manifest(run, 1, "update").files if n.startswith("trainer_state/rank-")})
        assert shards == (["rank-0", "rank-1"] if zero else [])
        rollout = store.manifest(run, 1, "rollout")
        assert rollout.meta["generated_by"].get("ranks", 1) == (1 if zero == 3 else 2)
        got = store.read_table(rollout, "rollouts.parquet").column("response_ids")
        assert got.equals(samples)
        w2 = update_weights(store, two.run_name, 1)
        init_ref = store.manifest(two.run_name, 1, "update").meta["policy_ref"]
        init = store.manifest(init_ref["run"], init_ref["iteration"], init_ref["stage"])
        start = load_safetensors(store.read_bytes(init, "model/model.safetensors"))
        assert max((w2[k] - start[k]).abs().max().item() for k in start) > 1e-4  # the weights really moved
        diff = max((w2[k] - w1[k]).abs().max().item() for k in w1)
        assert diff < 1e-5, (engine, zero, diff)
    last = results[engines[0]]["history"][-1]
    assert last["actor/grad_norm"] > 0
    # the iteration's whole wall (what bench/vs_trl.py counts) holds its stages and the bookkeeping after them
    assert last["wall_s"] > last["timing_s/iteration"] >= last["timing_s/update"] > 0


@pytest.mark.invariant("killed and continued == undisturbed", "every artifact's checksum")
def test_killed_trainer_ranks_are_rebuilt_to_identical_artifacts(prefect_api, tmp_path):
    """SIGKILL of rank 1 in update 1 and of rank 0 in update 2 (world size 2, ZeRO-2: each rank stores its optimizer
    partition): the stage's retry re-forms the group, each rank loads its partition of update 1 from the store, and
    every artifact equals an uninterrupted run's, with weights that really moved."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    world2 = ["ray.trainer_world_size=2", "ray.worker_num_cpus=0.5", "actor.engine=deepspeed", "actor.zero_stage=2"]
    reference = tiny_config(tmp_path / "ref", "k", *world2)
    train(config=reference)
    markers = tmp_path / "markers"
    markers.mkdir()
    drill = ["drill.kill_worker_at=['update@rank1:1','update:2']", f"drill.markers={markers}"]
    killed = tiny_config(tmp_path / "killed", "k", *world2, *drill)
    result = train(config=killed)
    assert sorted(p.name for p in markers.iterdir()) == ["kill_worker_at-update-2", "kill_worker_at-update@rank1-1"]
    # A killed worker's temporary folder is removed by the next worker started on the node (this test process's
    # workers keep theirs in a folder of their own: another process's are not this test's business).
    assert not glob.glob(os.path.join(scratch_root(), "rlstage-worker-p*-k-*"))
    assert [h["iteration"] for h in result["history"]] == [0, 1, 2]
    ref_store, store = store_for(reference), store_for(killed)
    sums = checksums(store, "k", 2)
    assert sums == checksums(ref_store, "k", 2)
    assert {f"{k}/update/trainer_state/rank-{r}/trainer_state.safetensors" for k in (1, 2) for r in (0, 1)} <= set(sums)
    w1, w2 = update_weights(store, "k", 1), update_weights(store, "k", 2)
    assert weights_moved(w1, w2)  # the drills ran where the weights change
    # Resuming with one rank: refused before iteration 3 computes anything, naming the setting.
    one = tiny_config(tmp_path / "killed", "k", *world2[2:], "trainer.iterations=3")
    with pytest.raises(ConfigError, match=r"^config error: ray.trainer_world_size: checkpoint k/iter-2/update holds the optimizer partitions of 2 ranks"):
        train(config=one)
    assert store.manifest("k", 3, "rollout") is None


def test_a_checkpoint_larger_than_the_object_store_never_crosses_it(prefect_api, tmp_path):
    """Weights + optimizer state of ~160 MB (the object store holds 128 MB) go worker -> store -> worker."""
    import ray

    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    wide = ["kit.hidden_size=512", "kit.num_layers=4", "kit.num_heads=8", "kit.intermediate_size=1536", "sft.steps=4"]
    cfg = tiny_config(tmp_path, "wide", *wide, "trainer.checkpoint_every=1")
    before = set(glob.glob(os.path.join(scratch_root(), "rlstage-worker-p*-wide-*")))
    train(config=cfg)
    store = store_for(cfg)
    m = store.manifest("wide", 2, "update")
    ckpt = sum(e.bytes for e in m.files.values())
    assert ckpt > ray.available_resources().get("object_store_memory", 0) and ckpt > 128 << 20
    w1, w2 = update_weights(store, "wide", 1), update_weights(store, "wide", 2)
    assert weights_moved(w2, w1)
    # Iteration 2's rollout started from iteration 1's committed update: the worker held it, nothing reloaded.
    assert store.manifest("wide", 2, "rollout").inputs["policy"] == store.manifest("wide", 1, "update").artifact_id
    leftover = set(glob.glob(os.path.join(scratch_root(), "rlstage-worker-p*-wide-*"))) - before
    assert not leftover  # fetched and staged checkpoints are removed with the workers


def test_a_placement_the_cluster_cannot_hold_is_refused_before_any_stage(prefect_api, tmp_path):
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    cfg = tiny_config(tmp_path, "big", "ray.trainer_world_size=4", "actor.engine=deepspeed")
    with pytest.raises(ConfigError, match=r"ray.trainer_world_size=4 x ray.worker_num_cpus=1 .* the Ray cluster has"):
        train(config=cfg)
    apart = tiny_config(tmp_path, "big", "actor.use_kl_loss=true", "ray.ref_critic_placement=separate", "ray.ref_critic_num_cpus=64")
    with pytest.raises(ConfigError, match=r"x ray.worker_num_cpus=1 \+ ray.ref_critic_num_cpus=64 plus .* the Ray cluster has"):
        train(config=apart)
    assert store_for(cfg).iterations("big") == []


def test_a_world_size_that_does_not_split_the_mini_batch_is_one_line():
    # what a reference needs, and whether a role placed apart has one to hold: the registries know
    from rlstage.engines.preflight import check_registered_names

    with pytest.raises(ConfigError, match="ray.trainer_world_size=3 must divide actor.ppo_mini_batch_size=16"):
        load_config(None, [*tiny_overrides(), "ray.trainer_world_size=3", "actor.engine=deepspeed"])
    load_config(None, [*tiny_overrides(), "ray.trainer_world_size=2"])  # the torch engine: an all-reduce per step
    with pytest.raises(ConfigError, match="ray.ref_critic_placement=separate: this run has no reference policy"):
        check_registered_names(load_config(None, [*tiny_overrides(), "ray.ref_critic_placement=separate"]))
    with pytest.raises(ConfigError, match="ray.ref_critic_placement=separate: with model.lora_rank > 0 the reference"):
        lora = ["ray.ref_critic_placement=separate", "actor.use_kl_loss=true", "model.lora_rank=4"]
        check_registered_names(load_config(None, [*tiny_overrides(), *lora]))


def test_killed_role_workers_are_rebuilt_to_identical_artifacts(prefect_api, tmp_path):
    """SIGKILL of the rollout actor (placed apart) while it generates rollout 1 and eval 2 and while the trainer's
    push of iteration 1's policy for eval 1 reaches it (a version between checkpoints: in no store, only in the trainer), and of
    rank 0 while it serves the reference (advantage 1), the critic (advantage 2) and the old log-probs (advantage 2),
    and inside the critic's commit (iteration 1, between its files and its manifest): each stage's retry rebuilds the
    role (from the store, or pushed whole again from the trainer), and every artifact equals an uninterrupted run's."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    roles = [
        "ray.rollout_placement=separate", "ray.worker_num_cpus=0.5", "ray.rollout_num_cpus=0.5",
        "algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=16", "critic.micro_batch_size=8",
        "actor.use_kl_loss=true", "trainer.checkpoint_every=2", "rollout.weight_sync=delta",
    ]  # fmt: skip
    reference = tiny_config(tmp_path / "ref", "roles", *roles)
    train(config=reference)
    assert not any(f.startswith("model/") for f in store_for(reference).manifest("roles", 1, "update").files)
    markers = tmp_path / "markers"
    markers.mkdir()
    points = [
        "rollout@rollout:1", "advantage@ref:1", "eval@weights:1", "advantage@critic:2", "advantage@actor:2",
        "eval@rollout:2",
    ]  # fmt: skip
    in_commit = "drill.kill_in_commit=['critic:1']"
    killed = tiny_config(tmp_path / "killed", "roles", *roles, f"drill.kill_worker_at={points}", in_commit, f"drill.markers={markers}")
    result = train(config=killed)
    fired = [f"kill_worker_at-{p.replace(':', '-')}" for p in points] + ["kill_in_commit-critic-1"]
    assert sorted(p.name for p in markers.iterdir()) == sorted(fired)
    assert [h["iteration"] for h in result["history"]] == [0, 1, 2]
    store, ref_store = store_for(killed), store_for(reference)
    # A rollout actor's fresh load may round a log-prob by an ulp (see the placement test below): floats
    # of rollouts and experience within 1e-5, everything else byte for byte (the critic's checkpoints too).
    floats = ("rollouts.parquet", "experience.parquet")
    got, want = checksums(store, "roles", 2, (*iteration_stages(), "critic")), checksums(ref_store, "roles", 2, (*iteration_stages(), "critic"))
    assert any("/critic/" in k for k in got)
    assert {k: v for k, v in got.items() if not k.endswith(floats)} == {k: v for k, v in want.items() if not k.endswith(floats)}
    for k in (1, 2):
        a, b = (s_.read_table(s_.manifest("roles", k, "rollout"), "rollouts.parquet") for s_ in (store, ref_store))
        assert a.drop(["rollout_log_probs"]).equals(b.drop(["rollout_log_probs"]))
    from safetensors.torch import load

    # the drills ran where the weights change (iteration 1's lie between checkpoints: the start's against 2's)
    start = store.manifest("roles", 1, "update").meta["policy_ref"]
    w0 = load(store.read_bytes(store.manifest(start["run"], start["iteration"], start["stage"]), "model/model.safetensors"))
    assert weights_moved(w0, update_weights(store, "roles", 2))


@pytest.mark.invariant("colocated == rollout placed apart", "every stored file's checksum, but the rollout log-probs, within 1e-5")
def test_rollout_placed_apart_takes_weights_in_memory_and_overlaps_the_trainer(prefect_api, tmp_path):
    """The rollout role on two actors of its own, each generating a share of every batch, and the reference and
    critic (PPO with GAE and a KL loss) on an actor of theirs: same artifacts as with every role on rank 0,
    and a generating stage runs while an update of the trainer role trains (two stages of different roles
    overlap in time)."""
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from rlstage.flows.training import train
    from rlstage.schemas.manifest import PolicyRef
    from rlstage.tasks import stages
    from rlstage.tasks.runtime import policy_ref_from, store_for
    from rlstage.workers.group import open_group

    # HF batches of 16 samples (4 prompts): the 8 prompts of a rollout split between the two actors at a batch bound
    ppo = [
        "rollout.batch_size=16", "algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=16",
        "critic.micro_batch_size=8", "actor.use_kl_loss=true",
    ]  # fmt: skip
    colocated = tiny_config(tmp_path / "co", "p", *ppo)
    two = ["ray.rollout_num_workers=2", "ray.rollout_num_cpus=0.25", "ray.ref_critic_placement=separate", "ray.ref_critic_num_cpus=0"]
    apart = tiny_config(tmp_path / "apart", "p", *ppo, "ray.rollout_placement=separate", "ray.worker_num_cpus=0.5", *two)
    train(config=colocated)
    train(config=apart)
    store, co = store_for(apart), store_for(colocated)
    # The same samples, rewards and updates; the sampler's log-probs (copied into the experience) may differ
    # by an ulp: a model loaded apart runs the same kernels on other memory (measured 4.8e-7 on 2 of 256 tokens).
    floats = ("rollouts.parquet", "experience.parquet")
    same = {k: v for k, v in checksums(store, "p", 2, (*iteration_stages(), "critic")).items() if not k.endswith(floats)}
    assert same == {k: v for k, v in checksums(co, "p", 2, (*iteration_stages(), "critic")).items() if not k.endswith(floats)}
    for k in (1, 2):
        ra, rc = (s_.read_table(s_.manifest("p", k, "rollout"), "rollouts.parquet") for s_ in (store, co))
        assert ra.drop(["rollout_log_probs"]).equals(rc.drop(["rollout_log_probs"]))
        gap = max(abs(u - v) for x, y in zip(ra["rollout_log_probs"].to_pylist(), rc["rollout_log_probs"].to_pylist(), strict=True) for u, v in zip(x, y, strict=True))
        assert gap < 1e-5
    ro2 = store.manifest("p", 2, "rollout")
    assert ro2.meta["generated_by"]["placement"] == "separate"
    assert ro2.meta["generated_by"]["weights"] == "trainer"  # in memory from the trainer, not a folder or the store
    assert ro2.meta["generated_by"]["pid"] != store.manifest("p", 2, "update").meta["trained_on"][0]["pid"]
    workers = ro2.meta["generated_by"]["workers"]
    assert len({w["pid"] for w in workers}) == 2 and {w["weights"] for w in workers} == {"trainer"}
    # the reference and the critic were served, and the critic trained, by another actor than the trainer's
    for k in (1, 2):
        served = store.manifest("p", k, "advantage").meta["served_on"]
        pids = {served["ref"]["pid"], served["critic"]["pid"], store.manifest("p", k, "critic").meta["trained_on"]["pid"]}
        assert len(pids) == 1 and pids != {store.manifest("p", k, "update").meta["trained_on"][0]["pid"]}
        assert co.manifest("p", k, "advantage").meta["served_on"]["ref"]["pid"] == co.manifest("p", k, "update").meta["trained_on"][0]["pid"]

    # Overlap without a race: the trainer's update of iteration 1 holds inside its call (a drill point)
    # until the eval stage, served by the rollout actor, has generated; with one actor for both roles the
    # eval could never run during the held update.
    markers = tmp_path / "hold"
    markers.mkdir()
    drill = apart.drill.model_copy(update={"hold_worker_at": ["update:1"], "markers": str(markers)})
    held = apart.model_copy(update={"trainer": apart.trainer.model_copy(update={"eval_n": 4}), "drill": drill})
    prompts = store.manifest("p", None, "data_prep")
    experience = store.manifest("p", 1, "advantage")
    start = PolicyRef.model_validate(store.manifest("p", 1, "update").meta["policy_ref"])  # update 1's input policy
    after = policy_ref_from(store.manifest("p", 1, "update"))

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def both():
        u = stages.update.submit(held, 1, experience=experience, policy=start, version="overlap")
        deadline = time.monotonic() + 300
        while not (markers / "held-update-1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        e = stages.evaluate.submit(held, 1, prompts=prompts, policy=after, version="overlap")
        try:
            e.result()
        finally:
            (markers / "release-update-1").touch()
        return u.result()

    group = open_group(held, "overlap")  # held by the test so both stage tasks find the same actors
    try:
        group.acquire_rollout(after)  # the eval then needs nothing of the trainer, which will be held
        both()
        trained = group.call(Trainer.busy_intervals)
        generated = [g for a in group.rollouts for g in ray_get(a.busy_intervals.remote())]
    finally:
        group.release()
    assert len(trained) == 1 and generated
    (ts, te), (gs, ge) = trained[0], (min(g[0] for g in generated), max(g[1] for g in generated))
    assert ts < gs and ge < te, (trained, generated)  # every generate call inside the held update


def ray_get(ref):
    import ray

    return ray.get(ref)


MULTINODE = r"""
import json, sys
import psutil, ray
from ray.cluster_utils import Cluster
from rlstage.schemas.config import load_config
from rlstage.flows.training import train
from rlstage.tasks.runtime import store_for

def _connections(p):
    try:
        return p.net_connections()
    except psutil.NoSuchProcess:  # a short-lived helper process ended between the listing and this call
        return []


if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 80 << 20})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    cfg = load_config(None, sys.argv[1:] + [f"ray.address={cluster.address}"])
    train(config=cfg)
    store = store_for(cfg)
    out = {
        "rollout": [store.manifest(cfg.run_name, k, "rollout").meta["generated_by"] for k in (1, 2, 3)],
        "update": [store.manifest(cfg.run_name, k, "update").meta["trained_on"] for k in (1, 2, 3)],
        "stored": [any(f.startswith("model/") for f in store.manifest(cfg.run_name, k, "update").files) for k in (1, 2, 3)],
        "nodes": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()},
        "listening": sorted({c.laddr.ip for p in psutil.Process().children(recursive=True) for c in _connections(p) if c.status == "LISTEN"}),
    }
    print("RESULT " + json.dumps(out))
    ray.shutdown()
    cluster.shutdown()
"""


def test_two_node_cluster_trainer_on_one_node_rollout_on_the_other(prefect_api, tmp_path):
    """A two-raylet Ray cluster on this machine: the trainer on node_a, the rollout worker on node_b, new
    weights crossing nodes in memory (whole, then as deltas), every listener on 127.0.0.1."""
    import json
    import subprocess
    import sys

    args = [
        f"store.root={tmp_path / 'store'}", "run_name=mn", *tiny_overrides(), "actor.entropy_coeff=0.01",
        "trainer.iterations=3", "trainer.checkpoint_every=2", "rollout.weight_sync=delta", "ray.rollout_placement=separate", "ray.worker_num_cpus=0.5", "ray.rollout_num_cpus=0.5",
        "ray.trainer_resources={node_a: 1}", "ray.rollout_resources={node_b: 1}",
        "ray.stages={rollout: {num_cpus: 0.25}, reward: {num_cpus: 0.25}, advantage: {num_cpus: 0.25}, update: {num_cpus: 0.25}, eval: {num_cpus: 0.25}, data_prep: {num_cpus: 0.25}}",
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", MULTINODE, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(out["nodes"]) == 2 and set(out["nodes"].values()) == {"127.0.0.1"}
    for gen, trained in zip(out["rollout"], out["update"], strict=True):
        assert gen["placement"] == "separate" and gen["node"] != trained[0]["node"]
    # iteration 1's policy reached node_b in memory (Ray's object store), whole; iteration 2's as a delta against it,
    # and no update between checkpoints wrote weights anywhere
    assert [g["weights"] for g in out["rollout"][1:]] == ["trainer", "trainer-delta"]
    assert 0 < out["rollout"][2]["weight_bytes"] <= out["rollout"][1]["weight_bytes"]
    assert out["stored"] == [False, True, False]
    loopback = {ip.removeprefix("::ffff:") for ip in out["listening"]}  # IPv4-mapped IPv6 is the same address
    assert loopback == {"127.0.0.1"}, out["listening"]


GPU_BUNDLES = r"""
import json, sys
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from rlstage.schemas.config import ConfigError, load_config
from rlstage.workers.policy import scratch_root
from rlstage.workers.roles import Trainer
from rlstage.workers.group import check_placement, open_group

if __name__ == "__main__":
    # GPUs declared to Ray, none present: Ray schedules by them and sets each actor's CUDA_VISIBLE_DEVICES, torch
    # still computes on the CPU
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4, "node_ip_address": "127.0.0.1", "include_dashboard": False, "object_store_memory": 80 << 20})
    ray.init(address=cluster.address, namespace="rlstage")
    cfg = load_config(None, sys.argv[1:])
    check_placement(cfg)
    group = open_group(cfg)
    infos = group.query_all(Trainer.info)
    apart = {"rollout": ray.get(group.rollouts[0].info.remote()), "ref_critic": ray.get(group.ref_critic.info.remote())}
    tables = {role: placement_group_table(pg) for role, pg in group.placements.items()}
    again = open_group(cfg)  # a stage task's open finds the same groups and actors
    same = {r: pg.id for r, pg in again.placements.items()} == {r: pg.id for r, pg in group.placements.items()}
    same = same and group.query_all(Trainer.pid) == again.query_all(Trainer.pid)
    group.release()
    removed = sorted({placement_group_table(pg)["state"] for pg in group.placements.values()})
    too_many = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"worker_num_gpus": 2.0})})
    try:
        check_placement(too_many)
        refused = None
    except ConfigError as e:
        refused = str(e)
    bundles = {role: list(t["bundles"].values()) for role, t in tables.items()}
    strategies = sorted({t["strategy"] for t in tables.values()})
    print("RESULT " + json.dumps({"infos": infos, "apart": apart, "bundles": bundles, "strategies": strategies, "same": same, "removed": removed, "refused": refused}))
    ray.shutdown()
    cluster.shutdown()
"""


def test_roles_with_gpus_get_one_bundle_each_of_a_placement_group(tmp_path):
    """Roles that ask for GPUs are placed in placement groups (verl's resource pools): the trainer ranks one
    bundle of CPUs and a GPU per rank, the rollout workers and the reference-critic worker placed apart a
    group each; every actor sees its own GPU; release removes the groups; a placement asking for more GPUs
    than the cluster has is one line. On a Ray cluster that declares four GPUs."""
    import json
    import subprocess
    import sys

    args = [
        f"store.root={tmp_path / 'store'}", "run_name=gpu", *tiny_overrides(), "ray.trainer_world_size=2",
        "ray.worker_num_cpus=0.5", "ray.worker_num_gpus=1",
        "ray.rollout_placement=separate", "ray.rollout_num_cpus=0.25", "ray.rollout_num_gpus=1",
        "ray.ref_critic_placement=separate", "ray.ref_critic_num_cpus=0.25", "ray.ref_critic_num_gpus=1",
        "actor.use_kl_loss=true",  # a reference to hold apart
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", GPU_BUNDLES, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert [i["rank"] for i in out["infos"]] == [0, 1]
    gpus = [g for i in [*out["infos"], *out["apart"].values()] for g in i["gpus"]]
    assert sorted(gpus) == ["0", "1", "2", "3"]  # a GPU each, not the same one
    assert out["bundles"] == {
        "trainer": [{"CPU": 0.5, "GPU": 1.0}] * 2, "rollout": [{"CPU": 0.25, "GPU": 1.0}], "ref_critic": [{"CPU": 0.25, "GPU": 1.0}],
    }  # fmt: skip
    assert out["strategies"] == ["PACK"] and out["same"] and out["removed"] == ["REMOVED"]
    assert out["refused"] == (
        "config error: 2 x ray.worker_num_gpus=2 + 1 x ray.rollout_num_gpus=1 + 1 x ray.ref_critic_num_gpus=1 need 6 GPUs; "
        "the Ray cluster has 4"
    )


def _interval(m) -> tuple[float, float]:
    """When a stage computed: its compute seconds up to its commit."""
    from datetime import datetime

    end = datetime.fromisoformat(m.created_at).timestamp()
    return end - m.meta["compute_s"], end


def test_pipelined_iterations_overlap_rollout_with_training(prefect_api, tmp_path):
    """trainer.async_staleness=1: the rollout of iteration k+1 is submitted beside iteration k's reward, on
    the rollout role, and computes while update k trains; each rollout records the policy it sampled with.

    Overlap by construction, without a race on timestamps: update k holds inside the trainer's call (a drill
    point) and the rollout of k+1 holds inside its generate call; both are released only once both are held.
    Were rollout k+1 waiting on anything update k holds (the trainer, a CPU), the two would never be held at once.
    """
    import threading
    import time

    from rlstage.flows.training import train
    from rlstage.tasks.runtime import policy_ref_from, store_for

    stages_cpu = "ray.stages={" + ", ".join(f"{s}: {{num_cpus: 0.25}}" for s in ("data_prep", "rollout", "reward", "advantage", "update", "eval")) + "}"
    markers = tmp_path / "markers"
    markers.mkdir()
    pairs = [(f"update-{k}", f"rollout@rollout-{k + 1}") for k in (1, 2)]
    holds = [f"'{p.replace('-', ':')}'" for pair in pairs for p in pair]
    cfg = tiny_config(
        tmp_path, "async", "trainer.iterations=3", "trainer.async_staleness=1", "ray.rollout_placement=separate",
        "ray.worker_num_cpus=0.5", "ray.rollout_num_cpus=0.5", stages_cpu, "rollout.n=16", "data.prompts_per_iteration=32",
        "algorithm.rollout_correction.rollout_is=token", "trainer.eval_every=2", f"drill.hold_worker_at=[{', '.join(holds)}]", f"drill.markers={markers}",
    )  # fmt: skip
    together: list[str] = []

    def release_pairs() -> None:  # each pair released once both halves are held (a missing half: 240 s, then released)
        for update, rollout in pairs:
            deadline = time.monotonic() + 240
            while not all((markers / f"held-{p}").exists() for p in (update, rollout)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if all((markers / f"held-{p}").exists() for p in (update, rollout)):
                together.append(update)
            for p in (update, rollout):
                (markers / f"release-{p}").touch()

    releaser = threading.Thread(target=release_pairs, daemon=True)
    releaser.start()
    result = train(config=cfg)
    releaser.join(timeout=5)
    assert together == ["update-1", "update-2"], together  # rollout k+1 generated while update k trained
    store = store_for(cfg)
    m = {(k, s): store.manifest("async", k, s) for k in (1, 2, 3) for s in ("rollout", "advantage", "update")}
    start = m[1, "update"].meta["policy_ref"]["version"]
    # rollout k samples with the policy iteration k-1 started from: lag 1 from iteration 2 on
    assert m[1, "rollout"].inputs["policy"] == start and m[2, "rollout"].inputs["policy"] == start
    assert m[3, "rollout"].inputs["policy"] == policy_ref_from(m[1, "update"]).version
    # no eval in iteration 1 to load update 1's policy: rollout 3 read it from the store, asking nothing of the trainer
    assert m[3, "rollout"].meta["generated_by"]["weights"] == "store"
    assert m[2, "update"].inputs["policy"] == policy_ref_from(m[1, "update"]).version
    hist = {h["iteration"]: h for h in result["history"]}
    assert hist[1]["rollout/off_policy"] == 0 and hist[2]["rollout/off_policy"] == 1
    assert hist[3]["rollout/logprob_gap"] > 1e-4  # sampled by an older policy: the guard is off, IS weights on
    assert "rollout_corr/rollout_is_mean" in hist[3]
    assert weights_moved(update_weights(store, "async", 1), update_weights(store, "async", 3))
    assert train(config=cfg)["executed"] == []  # rerun: every stage committed, nothing executes


def test_bypass_takes_the_rollout_log_probs_as_old_and_checks_a_sample(prefect_api, tmp_path):
    """verl's bypass: no old-log-prob recompute but for a sample of rows that keeps the weight-sync guard."""
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for
    from rlstage.tasks.stages import BYPASS_CHECK_ROWS

    cfg = tiny_config(tmp_path, "bypass", "trainer.iterations=1", "algorithm.rollout_correction.bypass_mode=true")
    hist = train(config=cfg)["history"][-1]
    store = store_for(cfg)
    exp = store.read_table(store.manifest("bypass", 1, "advantage"), "experience.parquet")
    old, rollout = exp.column("old_log_probs").to_pylist(), exp.column("rollout_log_probs").to_pylist()
    same = sum(o == r for o, r in zip(old, rollout, strict=True))
    assert len(old) - BYPASS_CHECK_ROWS <= same < len(old) or hist["rollout/logprob_gap"] == 0.0
    assert 0 <= hist["rollout/logprob_gap"] < 1e-4
    assert update_weights(store, "bypass", 1) is not None and hist["actor/grad_norm"] > 0


def test_replay_and_eval_while_the_run_trains_corrupt_nothing(prefect_api, tmp_path):
    """A replay and an eval of a run that another process is training, on the same Ray cluster: they run on
    workers of their own, reproduce the stored checksums, and the training run's artifacts equal an
    undisturbed run's."""
    import subprocess
    import sys
    import time
    from datetime import datetime

    import ray

    from rlstage.flows.evaluate import evaluate_run
    from rlstage.flows.replay import replay
    from rlstage.flows.training import train
    from rlstage.tasks.runtime import store_for

    # A quarter CPU per worker: the held run, the replay and the eval fit beside whatever an earlier test of
    # this process left on its cluster (in CI the replay once waited out the 300 s hold, most likely for a CPU).
    small = "ray.worker_num_cpus=0.25"
    reference = tiny_config(tmp_path / "ref", "live", "trainer.iterations=4", small)
    train(config=reference)
    live = tiny_config(tmp_path / "live", "live", "trainer.iterations=1", small)
    train(config=live)
    store, root = store_for(live), live.store.root
    args = [f"store.root={root}", "run_name=live", *tiny_overrides(), *moving_overrides(), "trainer.iterations=4", small]
    args.append(f"ray.address={ray.get_runtime_context().gcs_address}")  # this process's cluster
    # its last update waits until the replay and eval have finished, and they start once it waits: they
    # overlap the run however slow the machine
    markers = tmp_path / "markers"
    markers.mkdir()
    args += ["drill.hold_worker_at=['update:4']", f"drill.markers={markers}"]
    log_path = tmp_path / "train.log"
    env = {**os.environ, "PYTHONPATH": source_path()}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlstage.flows.cli", "train", *args], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while store.get_json("live", "lease") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.get_json("live", "lease") is not None, log_path.read_text()[-3000:]
        while not (markers / "held-update-4").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (markers / "held-update-4").exists(), log_path.read_text()[-3000:]
        free = ray.available_resources().get("CPU", 0)  # said if the replay or eval waits for a CPU
        summary = replay(run_name="live", iteration=1, stage="update", store_root=root)
        evaluated = evaluate_run(run_name="live", iteration=1, store_root=root)
        replay_done = time.time()
        assert proc.poll() is None, f"CPUs free before the replay: {free}\n" + log_path.read_text()[-3000:]
        (markers / "release-update-4").touch()
        assert proc.wait(timeout=900) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert summary["identical"], summary["files_identical"]
    assert evaluated["version"] != "main"
    # They ran while the run trained: its last update was committed after both had finished.
    assert datetime.fromisoformat(store.manifest("live", 4, "update").created_at).timestamp() > replay_done
    assert checksums(store, "live", 4) == checksums(store_for(reference), "live", 4)
    w1, w4 = update_weights(store, "live", 1), update_weights(store, "live", 4)
    assert weights_moved(w1, w4)  # the weights really moved
