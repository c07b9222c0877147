"""The handle stage tasks and flows use to reach a run's policy roles on Ray.

One owner for which weights a role holds: ``acquire(ref)`` makes a role hold exactly the version a
stage asks for (or raises before anything is computed) and ``commit`` writes a role's new checkpoint
from the worker straight to the store. A flow owns the actor for its lifetime (``open_group`` ...
``release``); a replay or eval gets an actor of its own (its ``version`` is in the actor's name), so
it never relabels the weights of a run that is training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError

from infra.ray_runtime import RAY_NAMESPACE
from schemas.config import RunConfig
from schemas.manifest import Manifest, PolicyRef
from workers.policy import CRITIC_INIT, PolicyWorker

RESTART_WAIT_S = 120.0  # how long a call waits for Ray to restart a killed worker (7-19 s seen on 2 cores)


def total_update_steps(cfg: RunConfig) -> int:
    samples = cfg.data.prompts_per_iteration * cfg.rollout.n
    per_iter = -(-samples // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
    return max(1, per_iter * max(1, cfg.trainer.iterations))


def actor_name(run: str, version: str = "main") -> str:
    return f"policy-{run}" if version == "main" else f"policy-{run}@{version}"


@dataclass
class PolicyGroup:
    """The colocated policy, reference and critic roles of one run (one Ray actor, restarted on death)."""

    handle: Any
    name: str

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``ray.get`` of one worker call; a worker Ray is restarting is waited for, not raced."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return ray.get(getattr(self.handle, method).remote(*args, **kwargs))
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def acquire(self, ref: PolicyRef, role: str = "policy", update_hash: str | None = None) -> str:
        return self.call("acquire", ref.model_dump(mode="json"), role, update_hash)

    def commit(self, role: str, commit: dict, tables: dict) -> Manifest:
        return Manifest.model_validate(self.call("commit", role, commit, tables))

    def release(self) -> None:
        """Stop the worker: close its engines and scratch folder first (vLLM leaves /dev/shm files when killed)."""
        try:
            ray.get(self.handle.close.remote(), timeout=60)
        except Exception:  # a dead or hung worker still gets killed
            pass
        ray.kill(self.handle)


def open_group(cfg: RunConfig, version: str = "main") -> PolicyGroup:
    """The run's policy worker, created on first use (the flow keeps the handle: the actor lives as long)."""
    name = actor_name(cfg.run_name, version)
    cls = ray.remote(PolicyWorker)
    handle = cls.options(
        name=name,
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        num_cpus=cfg.ray.worker_num_cpus,
        num_gpus=cfg.ray.worker_num_gpus,
        max_restarts=-1,
        max_task_retries=0,
    ).remote(cfg.model_dump(mode="json"), total_update_steps(cfg))
    return PolicyGroup(handle, name)


def critic_init_ref(policy: PolicyRef) -> PolicyRef:
    """The critic's starting point: the initial policy's weights with a fresh value head."""
    return policy.model_copy(update={"version": CRITIC_INIT + policy.version})
