"""Evaluate a stored policy of a run on its held-out prompts, with the stored or changed settings.

The eval artifact is a sibling version (``eval-<hash of the eval stage's config view>``) of the
iteration's eval stage, so an extra evaluation (more samples, another reward function) never replaces
the one the run logged; a request whose eval settings are the same (overrides of settings eval does
not read included) is answered from the committed artifact.
"""

from __future__ import annotations

from prefect import flow

from rlstage.engines.preflight import preflight
from rlstage.flows.checks import check_eval, stored_config_with
from rlstage.flows.replay import stored_inputs
from rlstage.flows.training import name_flow_run
from rlstage.infra.ray_runtime import ensure_ray
from rlstage.infra.story import publish_eval
from rlstage.schemas.config import RunConfig
from rlstage.schemas.stages import STAGE_FILES, view_hash
from rlstage.tasks import stages
from rlstage.workers.group import check_placement, held_groups


def eval_version(cfg: RunConfig) -> str:
    return f"eval-{view_hash(cfg, 'eval')}"


@flow(name="rlstage-eval")
def evaluate_run(
    run_name: str, iteration: int | None = None, store_root: str = "./rlstage-runs", overrides: list[str] | None = None
) -> dict:
    """Score the policy after update ``iteration`` (default: the last committed; 0: the start policy)."""
    overrides = list(overrides or [])
    store, cfg = stored_config_with(store_root, run_name, overrides, "an evaluation")
    preflight(cfg)
    iteration = check_eval(store, run_name, iteration)
    name_flow_run(f"{run_name} eval of iteration {iteration}")
    inputs = stored_inputs(cfg, store, "eval", iteration)  # the prompts, and the policy after update k
    policy = inputs["policy"]
    version = eval_version(cfg)
    ensure_ray(cfg)
    check_placement(cfg)
    with held_groups(cfg, version):  # its own worker (never a training run's), started if the eval computes
        meta = {"eval_of": policy.version, "overrides": overrides}
        result = stages.result_of(stages.TASKS["eval"](cfg, iteration, **inputs, version=version, meta=meta))
    out = {
        "run": run_name,
        "iteration": iteration,
        "policy": policy.version,
        "version": version,
        "executed": result.executed,
        "artifact": store.uri(result.manifest, STAGE_FILES["eval"]),
        "metrics": result.metrics,
    }
    return {**out, **publish_eval(cfg, out, overrides)}
