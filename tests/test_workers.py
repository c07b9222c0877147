"""Worker groups in the pipeline: data-parallel trainer ranks, checkpoints that never cross Ray as
bytes, placements the cluster cannot hold refused before any stage."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest
import torch
from safetensors.torch import load as load_safetensors

from schemas.config import ConfigError, load_config
from tests_support import tiny_overrides

pytestmark = pytest.mark.slow


def _cfg(root, run: str, *extra: str):
    # An entropy bonus moves the weights even when the tiny model earns no reward yet.
    base = [f"store.root={root}", f"run_name={run}", *tiny_overrides(), "actor.entropy_coeff=0.01", "actor.optim.lr=1e-3"]
    return load_config(None, [*base, *extra])


def _weights(store, run: str, iteration: int) -> dict[str, torch.Tensor]:
    m = store.manifest(run, iteration, "update")
    return load_safetensors(store.read_bytes(m, "model/model.safetensors"))


@pytest.mark.parametrize(
    "mode,budget",
    [("token-mean", None), ("seq-mean-token-mean", 24)],
    ids=["token-mean", "seq-mean-token-mean+token-budget"],
)
def test_two_trainer_ranks_train_the_policy_one_rank_does(prefect_api, tmp_path, mode, budget):
    """World size 2 (DeepSpeed over gloo, two Ray actors) gives world size 1's (torch engine) policy."""
    from flows.training import train
    from tasks.runtime import store_for

    common = ["trainer.iterations=1", f"actor.loss_agg_mode={mode}", "actor.ppo_epochs=2"]
    if budget:
        common += [f"actor.micro_batch_tokens={budget}", "data.max_prompt_length=16"]
    one = _cfg(tmp_path, "dp1", *common)
    two = _cfg(
        tmp_path, "dp2", *common, "ray.trainer_world_size=2", "ray.worker_num_cpus=0.5", "actor.engine=deepspeed"
    )
    train(config=one)
    result = train(config=two)
    store = store_for(one)
    w1, w2 = _weights(store, "dp1", 1), _weights(store, "dp2", 1)
    init_ref = store.manifest("dp2", 1, "update").meta["policy_ref"]
    init = store.manifest(init_ref["run"], init_ref["iteration"], init_ref["stage"])
    start = load_safetensors(store.read_bytes(init, "model/model.safetensors"))
    assert max((w2[k] - start[k]).abs().max().item() for k in start) > 1e-4  # the weights really moved
    diff = max((w2[k] - w1[k]).abs().max().item() for k in w1)
    assert diff < 1e-5, diff
    assert result["history"][-1]["actor/grad_norm"] > 0
    h1 = train(config=one)["history"][-1]  # rerun: every stage committed, nothing executes
    assert h1["executed"] == []


def test_a_checkpoint_larger_than_the_object_store_never_crosses_it(prefect_api, tmp_path):
    """Weights + optimizer state of ~160 MB (the object store holds 128 MB) go worker -> store -> worker."""
    import ray

    from flows.training import train
    from tasks.runtime import store_for

    wide = ["kit.hidden_size=512", "kit.num_layers=4", "kit.num_heads=8", "kit.intermediate_size=1536", "sft.steps=4"]
    cfg = _cfg(tmp_path, "wide", *wide, "trainer.checkpoint_every=1")
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlstage-worker-wide-*")))
    train(config=cfg)
    store = store_for(cfg)
    m = store.manifest("wide", 2, "update")
    ckpt = sum(e.bytes for e in m.files.values())
    assert ckpt > ray.available_resources().get("object_store_memory", 0) and ckpt > 128 << 20
    assert any((a - b).abs().max() > 0 for a, b in zip(_weights(store, "wide", 2).values(), _weights(store, "wide", 1).values(), strict=True))
    # Iteration 2's rollout started from iteration 1's committed update: the worker held it, nothing reloaded.
    assert store.manifest("wide", 2, "rollout").inputs["policy"] == store.manifest("wide", 1, "update").artifact_id
    leftover = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlstage-worker-wide-*"))) - before
    assert not leftover  # fetched and staged checkpoints are removed with the workers


def test_a_placement_the_cluster_cannot_hold_is_refused_before_any_stage(prefect_api, tmp_path):
    from flows.training import train
    from tasks.runtime import store_for

    cfg = _cfg(tmp_path, "big", "ray.trainer_world_size=4", "actor.engine=deepspeed")
    with pytest.raises(ConfigError, match=r"ray.trainer_world_size=4 x ray.worker_num_cpus=1 .* the Ray cluster has"):
        train(config=cfg)
    assert store_for(cfg).iterations("big") == []


def test_a_world_size_that_does_not_split_the_mini_batch_is_one_line():
    with pytest.raises(ConfigError, match="ray.trainer_world_size=3 must divide actor.ppo_mini_batch_size=16"):
        load_config(None, [*tiny_overrides(), "ray.trainer_world_size=3", "actor.engine=deepspeed"])
    with pytest.raises(ConfigError, match="actor.engine=deepspeed and actor.zero_stage=0"):
        load_config(None, [*tiny_overrides(), "ray.trainer_world_size=2"])


def _checksums(store, run: str, iterations: int) -> dict[str, str]:
    out = {}
    for it in range(1, iterations + 1):
        for stage in ("rollout", "reward", "advantage", "update", "eval"):
            m = store.manifest(run, it, stage)
            assert m is not None, f"{stage} of iteration {it} not committed"
            out.update({f"{it}/{stage}/{name}": e.sha256 for name, e in m.files.items()})
    return out


def test_killed_trainer_ranks_are_rebuilt_to_identical_artifacts(prefect_api, tmp_path):
    """SIGKILL of rank 1 in update 1 and of rank 0 in update 2 (world size 2): the stage's retry re-forms the
    group from the store and every artifact equals an uninterrupted run's, with weights that really moved."""
    from flows.training import train
    from tasks.runtime import store_for

    world2 = ["ray.trainer_world_size=2", "ray.worker_num_cpus=0.5", "actor.engine=deepspeed"]
    reference = _cfg(tmp_path / "ref", "k", *world2)
    train(config=reference)
    markers = tmp_path / "markers"
    markers.mkdir()
    drill = ["drill.kill_worker_at=['update@rank1:1','update:2']", f"drill.markers={markers}"]
    killed = _cfg(tmp_path / "killed", "k", *world2, *drill)
    result = train(config=killed)
    assert sorted(p.name for p in markers.iterdir()) == ["kill_worker_at-update-2", "kill_worker_at-update@rank1-1"]
    assert [h["iteration"] for h in result["history"]] == [0, 1, 2]
    ref_store, store = store_for(reference), store_for(killed)
    assert _checksums(store, "k", 2) == _checksums(ref_store, "k", 2)
    w1, w2 = _weights(store, "k", 1), _weights(store, "k", 2)
    assert any((w1[k] - w2[k]).abs().max() > 0 for k in w1)  # the drills ran where the weights change
