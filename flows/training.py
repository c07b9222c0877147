"""The training flows: one iteration (a chain of stage tasks on Ray) and a training run of N.

A run continues where it stopped: every stage whose output is committed for the same inputs
and config is skipped, so rerunning the flow (or the nightly deployment) never repeats work.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

from prefect import flow, get_client, get_run_logger
from prefect.context import FlowRunContext, get_run_context
from prefect.logging.handlers import APILogHandler
from prefect_ray import RayTaskRunner

from infra.env import apply_defaults
from infra.lease import run_lease
from infra.ray_runtime import RAY_NAMESPACE, ensure_ray
from infra.store import ArtifactStore
from infra.tracking import Tracker, check_reachable, tracking_uri_for
from schemas.config import ConfigError, RunConfig, build_config, load_config, merge_dicts, parse_overrides
from schemas.manifest import Manifest, PolicyRef
from tasks import stages
from tasks.kit import initial_policy, sft_warm_start
from tasks.runtime import critic_init_ref, policy_ref_from, policy_worker, release_worker, store_for

# Fields that may differ between invocations of one run: where and how it executes, and how long.
RUN_MUTABLE = ("run_name", "store", "ray", "tracking", "trainer.iterations", "drill")


@dataclass
class IterationOutcome:
    iteration: int
    results: dict[str, stages.StageResult] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)

    @property
    def executed(self) -> list[str]:
        return [s for s, r in self.results.items() if r.executed]

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.results.values():
            out.update(r.metrics)
        for stage, wall in self.wall_s.items():
            out[f"timing_s/{stage}"] = wall
        total = sum(self.wall_s.values())
        if total > 0:
            out["timing_s/iteration"] = total
            compute = sum(r.seconds for r in self.results.values() if r.executed)
            if compute > 0:
                out["timing_s/orchestration_share"] = max(0.0, 1 - compute / total)
            if "rollout/tokens" in out:
                out["perf/throughput"] = out["rollout/tokens"] / total
        return out


# Progress lines also go to the flow run's logs in the Prefect UI: only there, the terminal has them.
_progress = logging.getLogger("rlstage.progress")
_progress.propagate = False
_progress.setLevel(logging.INFO)
_progress.addHandler(APILogHandler())


def _emit(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    if FlowRunContext.get() is not None:
        _progress.info(line.strip())


def _name_flow_run(name: str) -> None:
    """Prefect names flow runs at random; a training flow run is named after its run and iterations."""
    ctx = FlowRunContext.get()
    if ctx is not None:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, name=name)


def _run_stage(outcome: IterationOutcome, label: str, task_fn, cfg: RunConfig, stage: str, *args) -> stages.StageResult:
    t0 = time.perf_counter()
    _emit(f"  {label} {stage:<9} ...")
    result = stages.submit_stage(task_fn, cfg, stage, *args).result()
    wall = time.perf_counter() - t0
    outcome.results[stage] = result
    outcome.wall_s[stage] = wall
    stages.fault_point(cfg, stage, outcome.iteration, where="kill_flow_after")
    state = "done" if result.executed else "skipped (committed)"
    _emit(f"  {label} {stage:<9} {state} in {wall:.2f}s")
    return result


@dataclass
class Models:
    """What an iteration starts from: the policy, the frozen reference, the critic, the last experience."""

    policy: PolicyRef
    ref: PolicyRef | None = None
    critic: PolicyRef | None = None
    prev_experience: Manifest | None = None


def models_before(cfg: RunConfig, store: ArtifactStore, iteration: int, initial: PolicyRef) -> Models:
    """The models iteration ``iteration`` (>= 1) starts from, read from the store for k > 1."""
    ref = initial if cfg.needs_ref else None
    if iteration <= 1:
        return Models(initial, ref, critic_init_ref(initial) if cfg.critic.enable else None)

    def need(stage: str) -> Manifest:
        m = store.manifest(cfg.run_name, iteration - 1, stage)
        if m is None:
            raise ConfigError(f"config error: run {cfg.run_name!r} has no committed {stage} for iteration {iteration - 1}")
        return m

    return Models(
        policy_ref_from(need("update")),
        ref,
        policy_ref_from(need("critic")) if cfg.critic.enable else None,
        need("advantage"),
    )


@flow(name="rlstage-iteration")
def iteration_flow(cfg: RunConfig, iteration: int, prompts: Manifest, models: Models) -> IterationOutcome:
    """rollout -> reward -> advantage -> [critic] -> update -> eval; iteration 0 only evaluates."""
    out = IterationOutcome(iteration)
    label = f"[iter {iteration:>3}]"
    policy = models.policy
    if iteration > 0:
        ro = _run_stage(out, label, stages.rollout, cfg, "rollout", iteration, prompts, policy)
        rw = _run_stage(out, label, stages.reward, cfg, "reward", iteration, ro.manifest)
        adv = _run_stage(
            out, label, stages.advantage, cfg, "advantage", iteration, ro.manifest, rw.manifest, policy,
            models.ref, models.critic, models.prev_experience,
        )  # fmt: skip
        if models.critic is not None:
            _run_stage(out, label, stages.critic_update, cfg, "critic", iteration, adv.manifest, models.critic)
        up = _run_stage(out, label, stages.update, cfg, "update", iteration, adv.manifest, policy)
        policy = policy_ref_from(up.manifest)
    last = iteration == cfg.trainer.iterations
    if iteration == 0 or iteration % cfg.trainer.eval_every == 0 or last:
        _run_stage(out, label, stages.evaluate, cfg, "eval", iteration, prompts, policy)
    return out


def _identity(cfg: RunConfig) -> dict:
    dump = cfg.model_dump(mode="json")
    for path in RUN_MUTABLE:
        node = dump
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node.pop(leaf, None)
    return dump


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: stored {va!r}, given {vb!r}")
    return out


def record_run_config(store: ArtifactStore, cfg: RunConfig) -> None:
    """Store the resolved config with the run; refuse a later invocation whose config conflicts."""
    stored = store.get_json(cfg.run_name, "run.json")
    if stored is None:
        store.put_json(cfg.run_name, "run.json", {"config": cfg.model_dump(mode="json"), "identity": _identity(cfg)})
        return
    diff = _diff(stored["identity"], _identity(cfg))
    if diff:
        raise ConfigError(
            f"config error: run {cfg.run_name!r} exists with another config ({diff[0]}"
            f"{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}); use a new run_name or replay a stage"
        )


def stored_config(store: ArtifactStore, run_name: str) -> RunConfig:
    stored = store.get_json(run_name, "run.json")
    if stored is None:
        raise ConfigError(f"config error: run {run_name!r} does not exist under {store.root}")
    return RunConfig.model_validate(stored["config"])


def check_inputs(cfg: RunConfig) -> None:
    """Fail before anything is written when a named input does not exist."""
    from pathlib import Path

    if cfg.model.path is not None and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"model.path {cfg.model.path} is not a Hugging Face model directory")
    for key in ("train_path", "test_path"):
        value = getattr(cfg.data, key)
        if value is not None and "://" not in value and not Path(value).expanduser().is_file():
            raise FileNotFoundError(f"data.{key} {value} does not exist")


def _flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)
    except Exception:  # outside a flow run (plain function call)
        return ""


def run_training(cfg: RunConfig, first: int = 1, last: int | None = None) -> dict:
    """Run iterations ``first..last`` (default: all) of ``cfg``'s run, skipping committed stages."""
    apply_defaults()
    last = cfg.trainer.iterations if last is None else last
    check_inputs(cfg)
    check_reachable(tracking_uri_for(cfg))
    store = store_for(cfg)
    store.check_writable()
    record_run_config(store, cfg)
    ensure_ray(cfg)
    _name_flow_run(f"{cfg.run_name} iterations {first}-{last}" if last > first else f"{cfg.run_name} iteration {last}")
    _emit(f"rlstage: run {cfg.run_name!r}, iterations {first}..{last}, artifacts under {store.root}/{cfg.run_name}")
    with run_lease(store, cfg.run_name, label=f"flow run {_flow_run_id() or os.getpid()}") as renew:
        return _run_iterations(cfg, store, first, last, renew)


def _run_iterations(cfg: RunConfig, store: ArtifactStore, first: int, last: int, renew) -> dict:
    tracker = Tracker(cfg, tags={"rlstage.artifact_root": store.root, "prefect.flow_run_id": _flow_run_id()})
    runner = RayTaskRunner(address=cfg.ray.address, init_kwargs={"namespace": RAY_NAMESPACE})
    one_iteration = iteration_flow.with_options(task_runner=runner, flow_run_name=f"{cfg.run_name}-iter-{{iteration}}")
    # The driver owns the policy worker: a non-detached actor dies with its last handle, so this
    # one keeps it alive for the run while stage tasks look it up by name.
    worker = policy_worker(cfg)
    status = "FAILED"
    try:
        prep = stages.submit_stage(stages.data_prep, cfg, "data_prep").result()
        sft = None
        if cfg.model.path is None:
            _emit("  [kit] SFT warm start of the tiny model (reused when already committed) ...")
            sft = sft_warm_start.submit(cfg).result()
            _emit(f"  [kit] SFT checkpoint {sft.manifest.artifact_id[:8]}: held-out accuracy {sft.metrics['sft/test_accuracy']:.3f}")
        models = models_before(cfg, store, first, initial_policy(cfg, sft))
        history: list[dict] = []
        executed = [s for s, r in (("data_prep", prep), ("sft", sft)) if r is not None and r.executed]
        for it in range(0 if first == 1 else first, last + 1):
            t0 = time.perf_counter()
            renew()
            outcome = one_iteration(cfg, it, prep.manifest, models)
            if "update" in outcome.results:
                r = outcome.results
                models = Models(
                    policy_ref_from(r["update"].manifest),
                    models.ref,
                    policy_ref_from(r["critic"].manifest) if "critic" in r else None,
                    r["advantage"].manifest,
                )
            metrics = outcome.metrics()
            tracker.log_metrics(it, metrics)
            if "rollout" in outcome.results and outcome.results["rollout"].executed:
                _log_rollout_sample(cfg, tracker, it, outcome)
            _publish_iteration(cfg, store, tracker, outcome, metrics)
            history.append({"iteration": it, "executed": outcome.executed, **metrics})
            executed += [f"iter-{it}/{s}" for s in outcome.executed]
            acc = metrics.get("val/accuracy")
            score = metrics.get("critic/score/mean")
            _emit(
                f"iteration {it:>3}: "
                + (f"train reward {score:.3f} | " if score is not None else "")
                + (f"held-out accuracy {acc:.3f} | " if acc is not None else "")
                + f"{time.perf_counter() - t0:.1f}s, executed {len(outcome.executed)} stage(s)"
            )
        status = "FINISHED"
        return {
            "run": cfg.run_name,
            "store": store.root,
            "mlflow": tracker.run_url,
            "mlflow_run_id": tracker.run_id,
            "history": history,
            "executed": executed,
        }
    finally:
        tracker.finish(status)
        release_worker(worker)


def _publish_iteration(
    cfg: RunConfig, store: ArtifactStore, tracker: Tracker, outcome: IterationOutcome, metrics: dict
) -> None:
    """A Prefect table artifact per iteration: its metrics, artifact URIs and the MLflow run."""
    from prefect.artifacts import create_table_artifact

    rows = [{"name": k, "value": f"{v:.6g}"} for k, v in sorted(metrics.items())]
    for stage, result in outcome.results.items():
        m = result.manifest
        rows.append({"name": f"artifact/{stage}", "value": store.artifact_dir(m.run, m.iteration, m.stage, m.version)})
    rows.append({"name": "mlflow/run", "value": tracker.run_url})
    key = re.sub(r"[^a-z0-9-]", "-", f"{cfg.run_name}-iter-{outcome.iteration}".lower())
    create_table_artifact(table=rows, key=key, description=f"rlstage run {cfg.run_name}, iteration {outcome.iteration}")


def _log_rollout_sample(cfg: RunConfig, tracker: Tracker, it: int, outcome: IterationOutcome) -> None:
    n = cfg.tracking.rollout_sample_rows
    if n == 0:
        return
    store = store_for(cfg)
    ro = store.read_table(outcome.results["rollout"].manifest, "rollouts.parquet").slice(0, n)
    rw = store.read_table(outcome.results["reward"].manifest, "rewards.parquet").slice(0, n)
    tracker.log_table(
        {
            "prompt": ro.column("prompt").to_pylist(),
            "response": ro.column("response_text").to_pylist(),
            "reward": rw.column("score").to_pylist(),
        },
        f"rollouts/iter-{it:06d}.json",
    )


def resolve_config(
    config: RunConfig | None = None, config_path: str | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """The config model (as the Prefect UI form gives it) or a YAML file, plus dotted overrides."""
    if config is None:
        return load_config(config_path, overrides or [])
    if config_path is not None:
        raise ConfigError("config error: give either config or config_path, not both")
    return build_config(merge_dicts(config.model_dump(mode="json"), parse_overrides(overrides or [])))


@flow(name="rlstage-train")
def train(
    config: RunConfig | None = None, config_path: str | None = None, overrides: list[str] | None = None
) -> dict:
    """A training run: data prep, SFT warm start (tiny kit), then N iterations on Ray."""
    cfg = resolve_config(config, config_path, overrides)
    get_run_logger().info("training run %s", cfg.run_name)
    return run_training(cfg)
