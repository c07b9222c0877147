"""What a training run records as it goes: each iteration's metrics in MLflow, its Prefect artifacts, its line on the
terminal, and the run's history (what ``rlstage train`` prints and returns).

MLflow's records are written by a thread of their own (``Bookkeeper``) and the Prefect artifacts by the flow's thread
while the next iteration computes (``Meanwhile``, flows/overlap.py), so neither waits between two iterations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

from prefect.context import FlowRunContext
from prefect.logging.handlers import APILogHandler

from rlstage.flows.overlap import IterationThread, Meanwhile
from rlstage.flows.retention import prune_checkpoints
from rlstage.flows.terminal import TERMINAL, verbose
from rlstage.infra.bookkeeping import Bookkeeper
from rlstage.infra.store import ArtifactStore
from rlstage.infra.story import artifact_key
from rlstage.infra.tracking import Tracker
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import Manifest
from rlstage.schemas.stages import SPECS
from rlstage.tasks.runtime import store_for
from rlstage.tasks.stages import StageResult
from rlstage.workers.policy import MODEL_DIR


@dataclass
class IterationOutcome:
    iteration: int
    results: dict[str, StageResult] = field(default_factory=dict)
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


def emit(line: str) -> None:
    """A summary line: on the terminal and in the flow run's logs."""
    TERMINAL.line(line)
    if FlowRunContext.get() is not None:
        _progress.info(line.strip())


def detail(line: str) -> None:
    """Stage detail: a line under --verbose only."""
    if verbose():
        TERMINAL.line(line)




class RunRecords:
    """A training run's records: MLflow's run (``tracker``), the iterations so far (``history``) and the stages this
    invocation executed. An iteration walked again with nothing executed is not logged twice."""

    def __init__(self, cfg: RunConfig, store: ArtifactStore, first: int, last: int, tags: dict[str, str]) -> None:
        self.cfg, self.store, self.last = cfg, store, last
        self.tracker = Tracker(cfg, tags=tags)
        # Points the MLflow run already holds (runs logged before PROGRESS existed have timing_s/iteration).
        self.logged = self.tracker.logged_steps(PROGRESS, "timing_s/iteration")
        # Iterations an earlier invocation finished while the tracking server was away: from the store.
        caught = [it for it in range(first) if it not in self.logged] if first > 1 else []
        for it in caught:
            self.tracker.log_metrics(it, {**_stored_metrics(store, cfg.run_name, it), PROGRESS: float(it)})
        if caught:
            emit(f"  MLflow caught up with iteration(s) {', '.join(map(str, caught))} from the store")
        self.logged |= set(caught)
        self.history: list[dict] = []
        self.executed: list[str] = []
        self.books = Bookkeeper(delay_s=BOOKKEEPING_DELAY_S)
        self.publish = Meanwhile()
        self._mark = time.perf_counter()  # when the previous iteration's stages ended: an iteration's wall starts there

    def prepared(self, stage: str, result: StageResult) -> None:
        """A run's preparation stage (data prep, the kit's SFT start): its metrics at MLflow step 0."""
        if result.executed or 0 not in self.logged:
            self.tracker.log_metrics(0, result.metrics)
        if result.executed:
            self.executed.append(stage)

    def data_prepared(self, prep: StageResult) -> None:
        """Data prep's metrics (prompt counts, those dropped as over data.max_prompt_length) and its prompts."""
        self.prepared("data_prep", prep)
        self.tracker.log_prompts(self.store, prep.manifest)
        m = prep.metrics
        if dropped := m.get("data/train_dropped_overlong", 0) + m.get("data/test_dropped_overlong", 0):
            emit(f"  data prep: {dropped:.0f} prompt(s) over data.max_prompt_length={self.cfg.data.max_prompt_length} tokens dropped")

    def iterations_start(self) -> None:
        self._mark = time.perf_counter()

    def finished(self, run: IterationThread) -> None:
        """An iteration ended: its records (in the flow's thread, while the next one computes) and its line."""
        cfg, it, outcome = self.cfg, run.iteration, run.result()
        metrics = {**outcome.metrics(), PROGRESS: float(it)}
        self.history.append({"iteration": it, "executed": outcome.executed, **metrics})
        pruned = prune_checkpoints(cfg, self.store, it)  # after the iteration is whole: its policy is the newest kept
        self.publish.raise_failure()  # the previous iteration's artifacts, written during this one
        if pruned:
            detail(f"  checkpoint retention: pruned the weights of {', '.join(f'{m.stage} {m.iteration}' for m in pruned)}")
        # The iteration's whole wall (timing_s/iteration sums the stage walls): from the end of the previous
        # iteration's stages to the end of its own.
        assert run.stages_end is not None
        wall = outcome.wall_metrics(run.stages_end - self._mark)
        self._mark = run.stages_end
        metrics |= wall
        self.history[-1] |= {**wall, "wall_s": wall["timing_s/iteration_wall"]}
        history = [dict(h) for h in self.history]
        self.publish.defer(partial(_publish_iteration, cfg, self.store, self.tracker, outcome, dict(metrics), history))
        self.books.submit(partial(_track_iteration, cfg, self.store, self.tracker, outcome, metrics, pruned, it == self.last, it in self.logged))
        self.executed.extend(f"iter-{it}/{s}" for s in outcome.executed)
        TERMINAL.status(None)
        acc, val_reward = metrics.get("val/accuracy"), metrics.get("val/reward_mean")
        score = metrics.get("critic/score/mean")
        credit = acc is not None and val_reward is not None and abs(val_reward - acc) > 1e-9
        emit(
            f"iteration {it:>3}: "
            + (f"train reward {score:.3f} | " if score is not None else "")
            + ("every group scored the same within itself: no signal to learn from | " if flat_rewards(metrics) else "")
            + (f"held-out accuracy {acc:.3f} | " if acc is not None else "")
            + (f"held-out mean reward {val_reward:.3f} | " if credit else "")
            + f"{self.history[-1]['wall_s']:.1f}s, executed {len(outcome.executed)} stage(s)"
        )

    def close(self) -> None:
        """Every iteration is in MLflow and the Prefect UI before the run reports its end."""
        self.publish.run()  # the last iteration's artifacts
        self.publish.raise_failure()
        self.books.close()

    def end(self, status: str, stopped: bool) -> None:
        """The run ended (``status``: FINISHED, FAILED): a failed run's last iterations still show in the Prefect UI;
        a signal's stop (``stopped``) waits for nothing."""
        if not stopped:
            self.publish.run()
        self.books.close(raise_errors=False)  # a no-op after close
        self.tracker.finish(status)

    def summary(self) -> dict:
        t = self.tracker
        return {"run": self.cfg.run_name, "store": self.store.root, "mlflow": t.run_url, "mlflow_run_id": t.run_id,
                "history": self.history, "executed": self.executed}  # fmt: skip


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


