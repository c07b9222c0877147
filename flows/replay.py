"""Replay one stage of one iteration from its stored inputs.

With the stored config the output reproduces the original's checksums; with changed settings
(another reward function, estimator, learning rate) it becomes a sibling version of the
artifact, with its lineage recorded, and the original is never touched.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow

from flows.checks import check_replay, need, stored_config_with
from flows.training import models_before
from infra.ray_runtime import ensure_ray
from infra.store import ArtifactStore
from schemas.config import ConfigError, RunConfig
from schemas.manifest import Manifest, PolicyRef
from schemas.stages import STAGE_FILES
from tasks import stages
from tasks.kit import initial_policy, kit_run_name
from tasks.runtime import policy_ref_from, policy_worker, release_worker, store_for


def policy_before(cfg: RunConfig, store: ArtifactStore, iteration: int) -> PolicyRef:
    if iteration > 1:
        return policy_ref_from(need(store, cfg.run_name, iteration - 1, "update"))
    sft = None if cfg.model.path else need(store, kit_run_name(cfg), None, "sft")
    return initial_policy(cfg, None if sft is None else stages.StageResult(sft, executed=False))


def _check(original: Manifest, name: str, current: str) -> None:
    if original.inputs.get(name) != current:
        raise ConfigError(
            f"config error: the {name} input of {original.stage} at iteration {original.iteration} "
            "was replaced since it ran; replay the upstream stage first"
        )


def replay_version(overrides: list[str]) -> str:
    return "replay-" + hashlib.sha256(json.dumps(sorted(overrides)).encode()).hexdigest()[:10]


@flow(name="rlstage-replay")
def replay(
    run_name: str, iteration: int, stage: str, store_root: str = "./rlstage-runs", overrides: list[str] | None = None
) -> dict:
    """Re-execute ``stage`` of ``iteration`` into a sibling version; report checksums and a metric diff."""
    overrides = list(overrides or [])
    store, cfg = stored_config_with(store_root, run_name, overrides, "a replay")
    check_replay(store, run_name, iteration, stage)
    original = need(store, run_name, iteration, stage)
    version = replay_version(overrides)
    lineage = {"replay_of": original.artifact_id, "overrides": overrides}
    prompts = need(store, run_name, None, "data_prep")
    ensure_ray(cfg)
    worker = policy_worker(cfg)  # held for the replay so stage tasks find it alive
    try:
        if stage == "eval":
            policy = policy_before(cfg, store, iteration + 1)  # eval k scores the policy after update k
            _check(original, "policy", policy.version)
            result = stages.evaluate(cfg, iteration, prompts, policy, version=version, meta=lineage)
        else:
            policy = policy_before(cfg, store, iteration)
            if stage == "rollout":
                _check(original, "policy", policy.version)
                result = stages.rollout(cfg, iteration, prompts, policy, version=version, meta=lineage)
            elif stage == "reward":
                ro = need(store, run_name, iteration, "rollout")
                _check(original, "rollouts", ro.artifact_id)
                result = stages.reward(cfg, iteration, ro, version=version, meta=lineage)
            elif stage == "advantage":
                ro = need(store, run_name, iteration, "rollout")
                rw = need(store, run_name, iteration, "reward")
                _check(original, "rollouts", ro.artifact_id)
                _check(original, "rewards", rw.artifact_id)
                m = models_before(cfg, store, iteration, policy_before(cfg, store, 1))
                result = stages.advantage(
                    cfg, iteration, ro, rw, policy, m.ref, m.critic, m.prev_experience, version=version, meta=lineage
                )
            else:
                exp = need(store, run_name, iteration, "advantage")
                _check(original, "experience", exp.artifact_id)
                _check(original, "policy", policy.version)
                result = stages.update(cfg, iteration, exp, policy, version=version, meta=lineage)
    finally:
        release_worker(worker)
    return summarize(store_for(cfg), original, result.manifest)


def summarize(store: ArtifactStore, original: Manifest, replayed: Manifest) -> dict:
    main_file = STAGE_FILES[original.stage]
    same = {
        name: original.files[name].sha256 == entry.sha256
        for name, entry in replayed.files.items()
        if name in original.files
    }
    before, after = original.meta.get("metrics", {}), replayed.meta.get("metrics", {})
    diff = {k: (before[k], after[k]) for k in sorted(before) if k in after and isinstance(before[k], int | float)}
    return {
        "stage": original.stage,
        "iteration": original.iteration,
        "version": replayed.version,
        "artifact": store.uri(replayed, main_file),
        "identical": bool(same) and all(same.values()),
        "files_identical": same,
        "metrics": diff,
    }


def format_summary(s: dict) -> str:
    lines = [
        f"replayed {s['stage']} of iteration {s['iteration']} as version {s['version']}: {s['artifact']}",
        "output checksums " + ("equal the stored ones" if s["identical"] else "differ from the stored ones"),
    ]
    for k, (a, b) in s["metrics"].items():
        if k.startswith(("critic/", "actor/", "val", "response_length/mean", "rollout/logprob_gap")):
            lines.append(f"  {k}: {a:.4g} -> {b:.4g}")
    return "\n".join(lines)
