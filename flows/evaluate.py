"""Evaluate a stored policy of a run on its held-out prompts, with the stored or changed settings.

The eval artifact is a sibling version (``eval-<hash of the overrides>``) of the iteration's eval
stage, so an extra evaluation (more samples, another reward function) never replaces the one the
run logged; an identical request is answered from the committed artifact.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow

from flows.checks import check_eval, need, stored_config_with
from flows.replay import policy_before
from infra.ray_runtime import ensure_ray
from schemas.stages import STAGE_FILES
from tasks import stages
from tasks.runtime import policy_worker, release_worker


def eval_version(overrides: list[str]) -> str:
    return "eval-" + hashlib.sha256(json.dumps(sorted(overrides)).encode()).hexdigest()[:10]


@flow(name="rlstage-eval")
def evaluate_run(
    run_name: str, iteration: int | None = None, store_root: str = "./rlstage-runs", overrides: list[str] | None = None
) -> dict:
    """Score the policy after update ``iteration`` (default: the last committed; 0: the start policy)."""
    overrides = list(overrides or [])
    store, cfg = stored_config_with(store_root, run_name, overrides, "an evaluation")
    iteration = check_eval(store, run_name, iteration)
    prompts = need(store, run_name, None, "data_prep")
    policy = policy_before(cfg, store, iteration + 1)  # the policy after update k
    version = eval_version(overrides)
    ensure_ray(cfg)
    worker = policy_worker(cfg)  # held for the flow so the stage task finds it alive
    try:
        result = stages.evaluate(
            cfg, iteration, prompts, policy, version=version, meta={"eval_of": policy.version, "overrides": overrides}
        )
    finally:
        release_worker(worker)
    return {
        "run": run_name,
        "iteration": iteration,
        "policy": policy.version,
        "version": version,
        "executed": result.executed,
        "artifact": store.uri(result.manifest, STAGE_FILES["eval"]),
        "metrics": result.metrics,
    }
