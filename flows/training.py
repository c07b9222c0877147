"""The training flows: one iteration (a chain of stage tasks on Ray) and a training run of N.

A run continues where it stopped: every stage whose output is committed for the same inputs
and config is skipped, so rerunning the flow (or the nightly deployment) never repeats work.
"""

from __future__ import annotations

import os
import time
from functools import partial

import ray
from prefect import flow, get_client, get_run_logger
from prefect.context import FlowRunContext, get_run_context
from prefect.exceptions import TerminationSignal
from prefect.futures import PrefectFuture
from prefect.settings import temporary_settings

from rlstage.engines.preflight import preflight
from rlstage.flows.checks import check_inputs, check_run_config, record_run_config
from rlstage.flows.iteration import Artifacts, Models, iterate, models_before
from rlstage.flows.overlap import IterationThread, wait_event
from rlstage.flows.records import IterationOutcome, RunRecords, detail, emit
from rlstage.flows.terminal import TERMINAL
from rlstage.infra.drill import fault_point
from rlstage.infra.env import apply_defaults
from rlstage.infra.lease import run_lease
from rlstage.infra.prefect_server import quick_retries_on_a_local_server
from rlstage.infra.progress import open_board
from rlstage.infra.ray_runtime import STOPPING, ensure_ray, wait_result
from rlstage.infra.store import ArtifactStore
from rlstage.infra.tracking import check_reachable, tracking_uri_for
from rlstage.schemas.config import (
    ConfigError,
    RunConfig,
    build_config,
    load_config,
    merge_dicts,
    parse_overrides,
)
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import spec
from rlstage.tasks import stages
from rlstage.tasks.kit import initial_policy, kit_run_name  # also registers the sft stage's task
from rlstage.tasks.runtime import policy_ref_from, store_for
from rlstage.workers.group import check_placement, open_group
from rlstage.workers.reward_model import open_reward_model


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
        detail(f"  {self.label} {stage:<9} {'done' if result.executed else 'skipped (committed)'} in {wall:.2f}s")
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
        emit(f"  could not mark the dead holder's flow run {lease['flow_run_id']} as crashed: {err}")


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
    emit(f"rlstage: run {cfg.run_name!r}, iterations {first}..{last}, artifacts under {store.root}/{cfg.run_name}")
    flow_run_id = _flow_run_id()
    label = f"flow run {flow_run_id or os.getpid()}"
    with run_lease(store, cfg.run_name, label=label, flow_run_id=flow_run_id, on_takeover=_mark_crashed) as renew:
        return _run_iterations(cfg, store, first, last, renew)


def _run_iterations(cfg: RunConfig, store: ArtifactStore, first: int, last: int, renew) -> dict:
    records = RunRecords(cfg, store, first, last, tags={"rlstage.artifact_root": store.root, "prefect.flow_run_id": _flow_run_id()})
    one_iteration = iteration_flow.with_options(flow_run_name=f"{cfg.run_name}-iter-{{iteration}}")
    # The driver owns the policy worker: a non-detached actor dies with its last handle, so this
    # one keeps it alive for the run while stage tasks look it up by name.
    group = open_group(cfg)
    board = open_board() if TERMINAL.live else None  # SFT's steps on a terminal's status line
    rm_worker = open_reward_model(cfg) if cfg.reward_model.enable and cfg.reward_model.model.path else None  # noqa: F841 (held: the actor lives as long)
    status, stopped = "FAILED", False
    try:
        prep_task = stages.submit_stage(cfg, "data_prep", on_ray=False)
        prep = wait_result(prep_task)
        after: list = [prep_task]  # the flow graph: iteration 0 after data prep and SFT, each iteration after the last
        records.data_prepared(prep)
        record_run_config(store, cfg)  # after a failed first attempt, a corrected command is not "another config"
        sft = None
        if cfg.model.path is None:
            emit("  [kit] SFT warm start of the tiny model (reused when already committed) ...")
            TERMINAL.status("  [kit] SFT", read_note=_board_reader(board, kit_run_name(cfg)))
            sft_task = stages.submit_stage(cfg, "sft", wait_for=after, on_ray=False)
            sft = wait_result(sft_task)
            TERMINAL.status(None)
            after.append(sft_task)
            records.prepared("sft", sft)
            emit(f"  [kit] SFT checkpoint {sft.manifest.artifact_id[:8]}: held-out accuracy {sft.metrics['sft/test_accuracy']:.3f}")
        models = models_before(cfg, store, first, initial_policy(cfg, sft))
        # No heartbeats for the iterations' subflows: Prefect's heartbeat thread sleeps in 1 s steps and a flow's
        # end waits for it (the 1-second quantum of iteration walls); the run's own flow keeps its. Entered once:
        # building the settings costs ~65 ms.
        with temporary_settings(updates={"flows.heartbeat_frequency": None}):
            # Iteration k+1's subflow opens while k evaluates (IterationThread); its stages run after k's.
            open_: list[IterationThread] = []
            records.iterations_start()

            def finish(run: IterationThread) -> None:
                open_.remove(run)
                records.finished(run)

            try:
                evaluating: IterationThread | None = None  # an iteration whose eval may still run
                for it in range(0 if first == 1 else first, last + 1):
                    renew()
                    # The prompts' manifest rebuilt from JSON: Prefect links inputs to results by object id, and a
                    # deep copy keeps data prep's immutable values, drawing a fan-out from data prep to every iteration.
                    prompts = Manifest.model_validate_json(prep.manifest.model_dump_json())
                    call = partial(one_iteration, cfg, it, prompts, models, last, wait_for=after)
                    run = IterationThread(it, call, previous=evaluating, meanwhile=records.publish)
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
        records.close()
        status = "FINISHED"
        return records.summary()
    except (KeyboardInterrupt, TerminationSignal):  # a signal: a stage task may still be inside a worker's call
        stopped = True
        raise
    finally:
        TERMINAL.status(None)
        records.end(status, stopped)
        group.release(busy=stopped)


def _board_reader(board, key: str):
    if board is None:
        return None
    return lambda: ray.get(board.take.remote(key), timeout=2.0)


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
