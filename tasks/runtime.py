"""Shared plumbing of the stage tasks: the store, cache keys, and the policy worker actor."""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import lru_cache
from pathlib import Path

import ray

from infra.store import ArtifactStore
from schemas.config import RunConfig
from schemas.manifest import Manifest, PolicyRef
from tasks.policy_actor import CRITIC_INIT, PolicyWorker

RAY_NAMESPACE = "rlstage"

# What each stage's output depends on, as dotted config paths: the rest of the config may change.
STAGE_CONFIG = {
    "data_prep": ("data", "kit", "model.path"),  # prompt lengths are counted in the policy's tokens
    "rollout": ("rollout", "data.prompts_per_iteration", "data.shuffle_seed", "agent"),
    "reward": ("reward",),
    "advantage": ("algorithm", "rollout.temperature", "actor.use_kl_loss"),
    "update": ("actor", "rollout.temperature", "trainer.seed", "critic.warmup_iterations", "trainer.checkpoint_every"),
    "critic": ("critic", "trainer.seed"),
    "eval": ("rollout", "trainer.eval_n", "data.eval_size", "agent"),
    "sft": ("kit", "sft"),
}


@lru_cache(maxsize=1)
def code_version() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def store_for(cfg: RunConfig) -> ArtifactStore:
    return ArtifactStore(cfg.store.root, cfg.store.storage_options, retries=cfg.store.retries)


def stage_key(stage: str, inputs: dict[str, str], config_hash: str) -> str:
    blob = json.dumps({"stage": stage, "inputs": inputs, "config": config_hash}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def total_update_steps(cfg: RunConfig) -> int:
    samples = cfg.data.prompts_per_iteration * cfg.rollout.n
    per_iter = -(-samples // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
    return max(1, per_iter * max(1, cfg.trainer.iterations))


def policy_worker(cfg: RunConfig):
    """The run's policy worker actor, created on first use and restarted by Ray if it dies."""
    cls = ray.remote(PolicyWorker)
    return cls.options(
        name=f"policy-{cfg.run_name}",
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        num_cpus=cfg.ray.worker_num_cpus,
        num_gpus=cfg.ray.worker_num_gpus,
        max_restarts=-1,
        max_task_retries=0,
    ).remote(cfg.model_dump(mode="json"), total_update_steps(cfg))


def ensure_policy(worker, store: ArtifactStore, ref: PolicyRef, role: str = "policy") -> None:
    """Make the worker hold ``ref`` in ``role``: a no-op when it already does (the common case)."""
    if ray.get(worker.version.remote(role)) == ref.version:
        return
    if ref.path is not None:
        ray.get(worker.load.remote(ref.version, path=ref.path, role=role))
        return
    manifest = store.manifest(ref.run, ref.iteration, ref.stage)
    if manifest is None or manifest.artifact_id != ref.version.removeprefix(CRITIC_INIT):
        raise FileNotFoundError(f"checkpoint {ref.run}/iter-{ref.iteration}/{ref.stage} ({ref.version}) is not committed")
    files = {name: store.read_bytes(manifest, name) for name in manifest.files}
    ray.get(worker.load.remote(ref.version, files=files, role=role))


def critic_init_ref(policy: PolicyRef) -> PolicyRef:
    """The critic's starting point: the initial policy's weights with a fresh value head."""
    return policy.model_copy(update={"version": CRITIC_INIT + policy.version})


def policy_ref_from(manifest: Manifest) -> PolicyRef:
    return PolicyRef(version=manifest.artifact_id, run=manifest.run, iteration=manifest.iteration, stage=manifest.stage)


def release_worker(worker) -> None:
    """Stop the run's policy worker: close its engines first (vLLM leaves /dev/shm files when killed)."""
    try:
        ray.get(worker.close.remote(), timeout=60)
    except Exception:  # a dead or hung worker still gets killed
        pass
    ray.kill(worker)
