"""The training flows: one iteration (a chain of stage tasks on Ray) and a training run of N.

A run continues where it stopped: every stage whose output is committed for the same inputs
and config is skipped, so rerunning the flow (or the nightly deployment) never repeats work.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import ray
from prefect import flow, get_client, get_run_logger
from prefect.context import FlowRunContext, get_run_context
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.logging.handlers import APILogHandler
from prefect.settings import temporary_settings

from rlstage.engines.preflight import preflight
from rlstage.flows.checks import check_inputs, check_run_config, record_run_config
from rlstage.flows.iteration import Artifacts, Models, iterate, models_before
from rlstage.flows.overlap import IterationThread, Meanwhile, wait_event
from rlstage.flows.retention import prune_checkpoints
from rlstage.flows.terminal import TERMINAL, verbose
from rlstage.infra.bookkeeping import Bookkeeper
from rlstage.infra.drill import fault_point
from rlstage.infra.env import apply_defaults
from rlstage.infra.lease import run_lease
from rlstage.infra.prefect_server import quick_retries_on_a_local_server
from rlstage.infra.progress import open_board
from rlstage.infra.ray_runtime import STOPPING, ensure_ray, wait_result
from rlstage.infra.store import ArtifactStore
from rlstage.infra.story import artifact_key
from rlstage.infra.tracking import Tracker, check_reachable, tracking_uri_for
from rlstage.schemas.config import (
    ConfigError,
    RunConfig,
    build_config,
    load_config,
    merge_dicts,
    parse_overrides,
)
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import SPECS, spec
from rlstage.tasks import stages
from rlstage.tasks.kit import initial_policy, kit_run_name  # also registers the sft stage's task
from rlstage.tasks.runtime import policy_ref_from, store_for
from rlstage.workers.group import check_placement, open_group
from rlstage.workers.policy import MODEL_DIR
from rlstage.workers.reward_model import open_reward_model


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

    def wall_metrics(self, wall_s: float) -> dict[str, float]:
        """The iteration's whole wall (from the end of the previous iteration's stages to the end of its own)
        and the share of it that is not stage compute: orchestration (the stage tasks, whatever of the subflows
        and Prefect artifacts is not overlapped) and I/O."""
        out = {"timing_s/iteration_wall": wall_s}
        compute = sum(r.seconds for r in self.results.values() if r.executed)
        if compute > 0:
            out["timing_s/orchestration_share_of_wall"] = max(0.0, 1 - compute / wall_s)
        return out


# An iteration's MLflow records wait this long: MLflow's client holds the GIL ~0.1 s a job, which slowed the
# next subflow's start (~0.05 s an iteration); by then that subflow and its first stage task are under way.
BOOKKEEPING_DELAY_S = 0.5
PROGRESS = "progress/iteration"  # on every iteration's MLflow step: how a later invocation finds the steps MLflow lacks


def _stored_metrics(store: ArtifactStore, run: str, iteration: int) -> dict[str, float]:
    """An iteration's metrics as its committed stages recorded them (timings are not stored)."""
    out: dict[str, float] = {}
    for s in SPECS:
        m = store.manifest(run, iteration, s.name) if s.per_iteration else None
        out.update(m.meta.get("metrics", {}) if m is not None else {})
    return out


# Progress lines also go to the flow run's logs in the Prefect UI: only there, the terminal has them.
_progress = logging.getLogger("rlstage.progress")
_progress.propagate = False
_progress.setLevel(logging.INFO)
_progress.addHandler(APILogHandler())


def flat_rewards(metrics: dict) -> bool:
    """Every group of the iteration scored the same within itself (all 0, say): no group has an advantage to learn
    from. Iterations stored before the per-group share was a metric are judged by the whole batch's range."""
    if "reward/flat_group_share" in metrics:
        return metrics["reward/flat_group_share"] == 1.0
    hi, lo = metrics.get("critic/score/max"), metrics.get("critic/score/min")
    return hi is not None and lo is not None and hi == lo


def _emit(line: str) -> None:
    """A summary line: on the terminal and in the flow run's logs."""
    TERMINAL.line(line)
    if FlowRunContext.get() is not None:
        _progress.info(line.strip())


def _detail(line: str) -> None:
    """Stage detail: a line under --verbose only."""
    if verbose():
        TERMINAL.line(line)


def name_flow_run(name: str) -> None:
    """Prefect names flow runs at random (`tiny-kagu`); ours say what they are: the run and what it does."""
    ctx = FlowRunContext.get()
    if ctx is not None:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, name=name)


def _eval_due(cfg: RunConfig, iteration: int) -> bool:
    return iteration == 0 or iteration % cfg.trainer.eval_every == 0 or iteration == cfg.trainer.iterations


class StageTasks:
    """An iteration's stages as Prefect tasks whose bodies run on Ray (flows/iteration.py: ``Stages``). Each call
    submits the stage's task with its inputs by keyword, waits for it in short steps (a signal surfaces in the
    flow's thread), records its result and wall, and returns its output; the tasks that made its inputs in this
    iteration draw the flow graph's edges."""

    def __init__(self, cfg: RunConfig, iteration: int, last: int, outcome: IterationOutcome, a: Artifacts) -> None:
        self.cfg, self.iteration, self.outcome, self.held = cfg, iteration, outcome, a
        self.label = f"[iter {iteration:>3}/{last}]"
        self.overlap = IterationThread.current()  # None when iteration_flow is called on its own
        self._made: dict[int, tuple[Manifest | PolicyRef, PrefectFuture]] = {}  # an output -> the task that made it
        self._ahead: PrefectFuture | None = None
        self._update: PrefectFuture | None = None

    def __call__(self, stage: str, /, **inputs: Manifest | PolicyRef | None) -> Manifest | PolicyRef:
        s = spec(stage)
        if not s.active(self.cfg):
            raise RuntimeError(f"stage {stage!r} is not selected by this run's settings (schemas/stages.py: its when)")
        if s.phase == "eval":
            self._wait_ahead()
        made = [self._made[id(v)][1] for v in inputs.values() if id(v) in self._made]
        after = list({id(f): f for f in made}.values())  # filter_groups' one task made both rollouts and rewards
        # The next iteration opens once this one has trained: beside its eval (after the eval's first poll, so that its
        # requests do not meet the server's recording of the eval task's start: a 2 s client retry).
        under_way = self._trained if s.phase == "eval" else None
        t0 = time.perf_counter()
        TERMINAL.status(f"  {self.label} {stage:<9} ...")
        future = stages.submit_stage(self.cfg, stage, self.iteration, wait_for=after, **inputs)
        deferred = self.overlap.meanwhile if self.overlap is not None else None

        def meanwhile() -> None:
            if under_way is not None:
                under_way()
            if deferred is not None:
                deferred.run()

        result = wait_result(future, meanwhile=meanwhile)
        if under_way is not None:
            under_way()  # the stage ended within a poll
        wall = time.perf_counter() - t0
        self.outcome.results[stage] = result
        self.outcome.wall_s[stage] = wall
        fault_point(self.cfg, stage, self.iteration, where="kill_flow_after")
        _detail(f"  {self.label} {stage:<9} {'done' if result.executed else 'skipped (committed)'} in {wall:.2f}s")
        out = policy_ref_from(result.manifest) if s.output_ref else result.manifest
        self._made[id(out)] = (out, future)
        if stage == "update":
            self._update = future
        return out

    def ahead(self, stage: str, iteration: int, /, **inputs: Manifest | PolicyRef | None) -> None:
        self._ahead = stages.submit_stage(self.cfg, stage, iteration, ahead=True, **inputs)

    def eval_due(self, iteration: int) -> bool:
        return _eval_due(self.cfg, iteration)

    def _wait_ahead(self) -> None:
        if self._ahead is not None:
            wait_result(self._ahead)  # committed under the next iteration
            self._ahead = None

    def _trained(self) -> None:
        if self.overlap is not None:
            self.overlap.mark_trained(self.held if self._update is not None else None, self._update)

    def close(self) -> None:
        """The iteration's stages have ended (those it submitted ahead included)."""
        self._wait_ahead()
        self._trained()
        if self.overlap is not None:
            self.overlap.stages_ended()


@flow(name="rlstage-iteration")
def iteration_flow(cfg: RunConfig, iteration: int, prompts: Manifest, models: Models, last: int) -> IterationOutcome:
    """One iteration's stages (flows/iteration.py: ``iterate``), as tasks of this subflow."""
    out = IterationOutcome(iteration)
    overlap = IterationThread.current()
    if overlap is not None:
        overlap.after_previous_stages()
    a = Artifacts.start(prompts, models)
    run = StageTasks(cfg, iteration, last, out, a)
    iterate(cfg, iteration, last, a, run)
    run.close()
    return out


def with_model_folder(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.path`` a Hugging Face folder: a .gguf file is converted once (infra/models.py)."""
    if cfg.model.path is None or not cfg.model.path.lower().endswith(".gguf"):
        return cfg
    from rlstage.infra.models import resolve_model_path

    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": resolve_model_path(cfg.model.path)})})


def _flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)
    except Exception:  # outside a flow run (plain function call)
        return ""


def _mark_crashed(lease: dict) -> None:
    """The flow run of a dead lease holder (a killed process never reports its end) and its running
    iteration subflows become Crashed in Prefect, instead of Running forever."""
    if not lease.get("flow_run_id"):
        return
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    message = f"its process ({lease.get('host')}, pid {lease.get('pid')}) died; the run was taken over"
    try:
        with get_client(sync_client=True) as client:
            holder = client.read_flow_run(lease["flow_run_id"])
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[holder.id]))
            )
            for run in [holder, *children]:
                if run.state is not None and not run.state.is_final():
                    client.set_flow_run_state(run.id, Crashed(message=message), force=True)
    except Exception as err:  # another Prefect server, or none: the run goes on, the old state stays
        _emit(f"  could not mark the dead holder's flow run {lease['flow_run_id']} as crashed: {err}")


def run_training(cfg: RunConfig, first: int = 1, last: int | None = None) -> dict:
    """Run iterations ``first..last`` (default: all) of ``cfg``'s run, skipping committed stages."""
    apply_defaults()
    quick_retries_on_a_local_server()  # a deployment's or a test's flow run as well as the command's
    last = cfg.trainer.iterations if last is None else last
    cfg = with_model_folder(cfg)
    check_inputs(cfg)
    preflight(cfg)
    store = store_for(cfg)
    store.check_writable()  # before the tracking URI, which may create a folder under the store root
    check_run_config(store, cfg)  # recorded only once data prep has read its inputs (_run_iterations)
    check_reachable(tracking_uri_for(cfg))
    ensure_ray(cfg)
    check_placement(cfg)
    STOPPING.clear()  # a run stopped earlier in this process (by a signal) left it set
    name_flow_run(f"{cfg.run_name} iterations {first}-{last}" if last > first else f"{cfg.run_name} iteration {last}")
    _emit(f"rlstage: run {cfg.run_name!r}, iterations {first}..{last}, artifacts under {store.root}/{cfg.run_name}")
    flow_run_id = _flow_run_id()
    label = f"flow run {flow_run_id or os.getpid()}"
    with run_lease(store, cfg.run_name, label=label, flow_run_id=flow_run_id, on_takeover=_mark_crashed) as renew:
        return _run_iterations(cfg, store, first, last, renew)


def _run_iterations(cfg: RunConfig, store: ArtifactStore, first: int, last: int, renew) -> dict:
    tracker = Tracker(cfg, tags={"rlstage.artifact_root": store.root, "prefect.flow_run_id": _flow_run_id()})
    # Points the MLflow run already holds (runs logged before PROGRESS existed have timing_s/iteration):
    # an iteration walked again with nothing executed is not logged twice.
    logged = tracker.logged_steps(PROGRESS, "timing_s/iteration")
    # Iterations an earlier invocation finished while the tracking server was away: from the store.
    caught = [it for it in range(first) if it not in logged] if first > 1 else []
    for it in caught:
        tracker.log_metrics(it, {**_stored_metrics(store, cfg.run_name, it), PROGRESS: float(it)})
    if caught:
        _emit(f"  MLflow caught up with iteration(s) {', '.join(map(str, caught))} from the store")
    logged |= set(caught)
    one_iteration = iteration_flow.with_options(flow_run_name=f"{cfg.run_name}-iter-{{iteration}}")
    # The driver owns the policy worker: a non-detached actor dies with its last handle, so this
    # one keeps it alive for the run while stage tasks look it up by name.
    group = open_group(cfg)
    board = open_board() if TERMINAL.live else None  # SFT's steps on a terminal's status line
    rm_worker = open_reward_model(cfg) if cfg.reward_model.enable and cfg.reward_model.model.path else None  # noqa: F841 (held: the actor lives as long)
    status, stopped = "FAILED", False
    books = Bookkeeper(delay_s=BOOKKEEPING_DELAY_S)
    publish = Meanwhile()
    try:
        prep_task = stages.submit_stage(cfg, "data_prep", on_ray=False)
        prep = wait_result(prep_task)
        after: list = [prep_task]  # the flow graph: iteration 0 after data prep and SFT, each iteration after the last
        if prep.executed or 0 not in logged:  # prompt counts, and those dropped as over data.max_prompt_length
            tracker.log_metrics(0, prep.metrics)
        tracker.log_prompts(store, prep.manifest)
        dropped = prep.metrics.get("data/train_dropped_overlong", 0) + prep.metrics.get("data/test_dropped_overlong", 0)
        if dropped:
            _emit(f"  data prep: {dropped:.0f} prompt(s) over data.max_prompt_length={cfg.data.max_prompt_length} tokens dropped")
        record_run_config(store, cfg)  # after a failed first attempt, a corrected command is not "another config"
        sft = None
        if cfg.model.path is None:
            _emit("  [kit] SFT warm start of the tiny model (reused when already committed) ...")
            TERMINAL.status("  [kit] SFT", read_note=_board_reader(board, kit_run_name(cfg)))
            sft_task = stages.submit_stage(cfg, "sft", wait_for=after, on_ray=False)
            sft = wait_result(sft_task)
            TERMINAL.status(None)
            after.append(sft_task)
            if sft.executed or 0 not in logged:
                tracker.log_metrics(0, sft.metrics)
            _emit(f"  [kit] SFT checkpoint {sft.manifest.artifact_id[:8]}: held-out accuracy {sft.metrics['sft/test_accuracy']:.3f}")
        models = models_before(cfg, store, first, initial_policy(cfg, sft))
        history: list[dict] = []
        executed = [s for s, r in (("data_prep", prep), ("sft", sft)) if r is not None and r.executed]
        # No heartbeats for the iterations' subflows: Prefect's heartbeat thread sleeps in 1 s steps and a flow's
        # end waits for it (the 1-second quantum of iteration walls); the run's own flow keeps its. Entered once:
        # building the settings costs ~65 ms.
        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            # Iteration k+1's subflow opens while k evaluates (IterationThread); its stages run after k's.
            open_: list[IterationThread] = []
            mark = time.perf_counter()  # when the previous iteration's stages ended: an iteration's wall starts there

            def finish(run: IterationThread) -> None:
                """An iteration ended: its records (in the flow's thread, while the next one computes)."""
                nonlocal mark
                it, outcome = run.iteration, run.result()
                open_.remove(run)
                metrics = {**outcome.metrics(), PROGRESS: float(it)}
                history.append({"iteration": it, "executed": outcome.executed, **metrics})
                pruned = prune_checkpoints(cfg, store, it)  # after the iteration is whole: its policy is the newest kept
                publish.raise_failure()  # the previous iteration's artifacts, written during this one
                if pruned:
                    _detail(f"  checkpoint retention: pruned the weights of {', '.join(f'{m.stage} {m.iteration}' for m in pruned)}")
                # The iteration's whole wall (timing_s/iteration sums the stage walls): from the end of the previous
                # iteration's stages to the end of its own. Its MLflow records are written by the bookkeeper and its
                # Prefect artifacts by the flow's thread while the next iteration computes (Bookkeeper, Meanwhile).
                assert run.stages_end is not None
                wall = outcome.wall_metrics(run.stages_end - mark)
                mark = run.stages_end
                metrics |= wall
                history[-1] |= {**wall, "wall_s": wall["timing_s/iteration_wall"]}
                publish.defer(partial(_publish_iteration, cfg, store, tracker, outcome, dict(metrics), [dict(h) for h in history]))
                books.submit(partial(_track_iteration, cfg, store, tracker, outcome, metrics, pruned, it == last, it in logged))
                executed.extend(f"iter-{it}/{s}" for s in outcome.executed)
                TERMINAL.status(None)
                acc, val_reward = metrics.get("val/accuracy"), metrics.get("val/reward_mean")
                score = metrics.get("critic/score/mean")
                credit = acc is not None and val_reward is not None and abs(val_reward - acc) > 1e-9
                _emit(
                    f"iteration {it:>3}: "
                    + (f"train reward {score:.3f} | " if score is not None else "")
                    + ("every group scored the same within itself: no signal to learn from | " if flat_rewards(metrics) else "")
                    + (f"held-out accuracy {acc:.3f} | " if acc is not None else "")
                    + (f"held-out mean reward {val_reward:.3f} | " if credit else "")
                    + f"{history[-1]['wall_s']:.1f}s, executed {len(outcome.executed)} stage(s)"
                )

            try:
                evaluating: IterationThread | None = None  # an iteration whose eval may still run
                for it in range(0 if first == 1 else first, last + 1):
                    renew()
                    # The prompts' manifest rebuilt from JSON: Prefect links inputs to results by object id, and a
                    # deep copy keeps data prep's immutable values, drawing a fan-out from data prep to every iteration.
                    prompts = Manifest.model_validate_json(prep.manifest.model_dump_json())
                    call = partial(one_iteration, cfg, it, prompts, models, last, wait_for=after)
                    run = IterationThread(it, call, previous=evaluating, meanwhile=publish)
                    open_.append(run)
                    if evaluating is not None:
                        finish(evaluating)
                    wait_event(run.has_trained)
                    if run.trained is None:  # iteration 0 (eval only), or it failed
                        finish(run)
                        after, evaluating = [run.outcome], None  # a subflow's value stands for its run
                    else:
                        after, evaluating = [run.update_future], run  # the next one starts from this update
                        models = run.trained.models_after(models, pipelined=bool(cfg.trainer.async_staleness))
                if evaluating is not None:
                    finish(evaluating)
            except BaseException as err:
                # No subflow outlives the run: on a signal (or a failure with one still computing) its stages stop.
                if not isinstance(err, Exception) or any(not r.has_stages_ended.is_set() for r in open_):
                    STOPPING.set()
                for r in open_:
                    wait_event(r.done)
                raise
        publish.run()  # the last iteration's artifacts
        publish.raise_failure()
        books.close()  # MLflow and the Prefect UI hold every iteration before the run reports its end
        status = "FINISHED"
        return {
            "run": cfg.run_name,
            "store": store.root,
            "mlflow": tracker.run_url,
            "mlflow_run_id": tracker.run_id,
            "history": history,
            "executed": executed,
        }
    except (KeyboardInterrupt, TerminationSignal):  # a signal: a stage task may still be inside a worker's call
        stopped = True
        raise
    finally:
        TERMINAL.status(None)
        if not stopped:  # a failed run's last iterations still show in the Prefect UI; a signal's stop waits for nothing
            publish.run()
        books.close(raise_errors=False)  # a no-op after a finished run's close
        tracker.finish(status)
        group.release(busy=stopped)


def _board_reader(board, key: str):
    if board is None:
        return None
    return lambda: ray.get(board.take.remote(key), timeout=2.0)


def _track_iteration(
    cfg: RunConfig,
    store: ArtifactStore,
    tracker: Tracker,
    outcome: IterationOutcome,
    metrics: dict,
    pruned: list[Manifest],
    final: bool,
    logged: bool,
) -> None:
    """An iteration in MLflow (run by the bookkeeper's thread while the next iteration trains)."""
    it = outcome.iteration
    # The policy this invocation ends with, as an MLflow logged model with its iteration's metrics.
    update = outcome.results["update"].manifest if final and "update" in outcome.results else None
    model_id = tracker.log_policy(store, update, MODEL_DIR) if update is not None else None
    if outcome.executed or not logged:
        tracker.log_metrics(it, metrics, model_id=model_id)
    if "rollout" in outcome.results and outcome.results["rollout"].executed:
        _log_rollout_sample(cfg, tracker, it, outcome)
    for m in pruned:
        tracker.mark_pruned(m)  # its MLflow logged model points at files that are gone


def _publish_iteration(
    cfg: RunConfig, store: ArtifactStore, tracker: Tracker, outcome: IterationOutcome, metrics: dict, history: list[dict]
) -> None:
    """Prefect artifacts: the iteration's table under one key per run (a version per iteration, in order)
    and the run's progress so far (accuracy and reward per iteration, where the artifacts and metrics are)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"name": k, "value": f"{v:.6g}"} for k, v in sorted(metrics.items())]
    for stage, result in outcome.results.items():
        m = result.manifest
        rows.append({"name": f"artifact/{stage}", "value": store.artifact_dir(m.run, m.iteration, m.stage, m.version)})
    rows.append({"name": "mlflow/run", "value": tracker.run_url})
    it = outcome.iteration
    create_table_artifact(table=rows, key=artifact_key(cfg.run_name, "iteration"), description=f"rlstage run {cfg.run_name}, iteration {it}")

    def cell(h: dict, name: str) -> str:
        return f"{h[name]:.3f}" if name in h else ""

    lines = [
        f"# rlstage run `{cfg.run_name}`",
        f"Artifacts: `{store.root}/{cfg.run_name}` · MLflow: {tracker.run_url}",
        "",
        "| iteration | held-out accuracy | train reward | stages executed |",
        "|---:|---:|---:|---|",
        *(f"| {h['iteration']} | {cell(h, 'val/accuracy')} | {cell(h, 'critic/score/mean')} | {', '.join(h['executed'])} |" for h in history),
    ]
    create_markdown_artifact(
        markdown="\n".join(lines), key=artifact_key(cfg.run_name, "progress"), description=f"rlstage run {cfg.run_name}: iterations so far"
    )


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
