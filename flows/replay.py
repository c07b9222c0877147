"""Replay one stage of one iteration from its stored inputs.

With the stored config the output reproduces the original's checksums; with changed settings
(another reward function, estimator, learning rate) it becomes a sibling version of the
artifact, with its lineage recorded, and the original is never touched.
"""

from __future__ import annotations

import hashlib
import json

from prefect import flow

from rlstage.engines.preflight import preflight
from rlstage.flows.checks import check_replay, need, stored_config_with
from rlstage.flows.iteration import Artifacts, iterate, models_before
from rlstage.flows.training import name_flow_run
from rlstage.infra.ray_runtime import ensure_ray
from rlstage.infra.store import ArtifactStore
from rlstage.infra.story import publish_replay, published
from rlstage.schemas.artifacts import TIMING_COLUMNS
from rlstage.schemas.config import ConfigError, RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import STAGE_FILES, spec
from rlstage.tasks import stages
from rlstage.tasks.kit import initial_policy, kit_run_name
from rlstage.tasks.runtime import policy_ref_from, store_for
from rlstage.workers.group import check_placement, held_groups


def policy_before(cfg: RunConfig, store: ArtifactStore, iteration: int) -> PolicyRef:
    if iteration > 1:
        return policy_ref_from(need(store, cfg.run_name, iteration - 1, "update"))
    sft = None if cfg.model.path else need(store, kit_run_name(cfg), None, "sft")
    return initial_policy(cfg, None if sft is None else stages.StageResult(sft, executed=False))


def _check(original: Manifest, name: str, current: str) -> None:
    if name in original.inputs and original.inputs[name] != current:
        raise ConfigError(
            f"config error: the {name} input of {original.stage} at iteration {original.iteration} "
            "was replaced since it ran; replay the upstream stage first"
        )


def replay_version(overrides: list[str]) -> str:
    return "replay-" + hashlib.sha256(json.dumps(sorted(overrides)).encode()).hexdigest()[:10]


class _Reached(Exception):
    def __init__(self, inputs: dict) -> None:
        self.inputs = inputs


class StoredStages:
    """An iteration's stages as the store holds them (flows/iteration.py: ``Stages``): each stage before ``target``
    returns its committed output; ``target`` ends the walk with the inputs the iteration gives it."""

    def __init__(self, cfg: RunConfig, store: ArtifactStore, iteration: int, target: str) -> None:
        self.cfg, self.store, self.iteration, self.target = cfg, store, iteration, target

    def __call__(self, stage: str, /, **inputs: Manifest | PolicyRef | None) -> Manifest | PolicyRef:
        if stage == self.target:
            raise _Reached(inputs)
        m = need(self.store, self.cfg.run_name, self.iteration, stage)
        return policy_ref_from(m) if spec(stage).output_ref else m

    def ahead(self, stage: str, iteration: int, /, **inputs: Manifest | PolicyRef | None) -> None:
        pass  # a later iteration's stage: not this walk's

    def eval_due(self, iteration: int) -> bool:
        return True  # an eval of any iteration can be asked for (rlstage eval)


def stored_inputs(cfg: RunConfig, store: ArtifactStore, stage: str, iteration: int) -> dict[str, Manifest | PolicyRef | None]:
    """The inputs ``stage`` has at ``iteration``, by the names its spec declares: the iteration's own code
    (flows/iteration.py: ``iterate``) walked over the committed outputs of the stages before it. Iteration 0
    runs no train stage."""
    models = models_before(cfg, store, iteration, policy_before(cfg, store, 1))
    prompts = need(store, cfg.run_name, None, "data_prep")
    try:
        iterate(cfg, iteration, cfg.trainer.iterations, Artifacts.start(prompts, models), StoredStages(cfg, store, iteration, stage))
    except _Reached as reached:
        return reached.inputs
    raise ConfigError(f"config error: stage {stage!r} does not run at iteration {iteration} under the run's settings")


@flow(name="rlstage-replay")
def replay(
    run_name: str, iteration: int, stage: str, store_root: str = "./rlstage-runs", overrides: list[str] | None = None
) -> dict:
    """Re-execute ``stage`` of ``iteration`` into a sibling version; report checksums and a metric diff."""
    overrides = list(overrides or [])
    store, cfg = stored_config_with(store_root, run_name, overrides, "a replay")
    check_replay(store, run_name, iteration, stage)
    name_flow_run(f"{run_name} replay of {stage}, iteration {iteration}")
    preflight(cfg)
    original = need(store, run_name, iteration, stage)
    version = replay_version(overrides)
    lineage = {"replay_of": original.artifact_id, "overrides": overrides}
    inputs = stored_inputs(cfg, store, stage, iteration)
    for name, value in inputs.items():
        if value is not None:
            _check(original, name, value.artifact_id if isinstance(value, Manifest) else value.version)
    ensure_ray(cfg)
    check_placement(cfg)
    with held_groups(cfg, version):  # its own worker (never a training run's), started if the stage needs one
        result = stages.result_of(stages.TASKS[stage](cfg, iteration, **inputs, version=version, meta=lineage))
    summary = summarize(store_for(cfg), original, result.manifest)
    return {**summary, **publish_replay(cfg, summary, overrides, original.artifact_id)}


def _same_but_timing(store: ArtifactStore, original: Manifest, replayed: Manifest, name: str) -> bool:
    """Two Parquet files equal in every column but those of wall-clock time (an agent's turn seconds)."""
    if not name.endswith(".parquet"):
        return False
    a, b = store.read_table(original, name), store.read_table(replayed, name)
    timing = [c for c in TIMING_COLUMNS if c in a.column_names]
    return bool(timing) and a.drop_columns(timing).equals(b.drop_columns([c for c in timing if c in b.column_names]))


def summarize(store: ArtifactStore, original: Manifest, replayed: Manifest) -> dict:
    main_file = STAGE_FILES[original.stage]
    same = {
        name: original.files[name].sha256 == entry.sha256 or _same_but_timing(store, original, replayed, name)
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
    if "prefect_artifact" in s:
        lines.append(published(s))
    return "\n".join(lines)
