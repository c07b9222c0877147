"""One Prefect task per stage: read input artifacts, call an engine, commit the output artifact.

Every stage is skipped when its output for the same inputs and config view is already committed,
so rerunning an interrupted run continues where it stopped. Each task is registered against its
spec in ``schemas/stages.py`` (``stage_task``) and its body receives the stage's config view, so
it reads only what its cache key hashes. Retries and Ray resources come from
``ray.stages.<stage>`` in the config (see ``submit_stage``).

A training iteration's stage runs its body in a Ray worker (the stage's process) while its Prefect task
run is orchestrated from the flow's process: Prefect's task engine inside a Ray worker built two API
clients and its settings for every task (~0.14 s a stage, measured on a no-op task; 6 ms in the flow).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
import ray
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import StateDetails
from prefect.exceptions import MissingContextError
from prefect.states import Completed, State

from rlstage.engines import experience, tables
from rlstage.engines import metrics as eval_metrics
from rlstage.engines.agents.loop import AgentCompletion, agent_metrics
from rlstage.engines.agents.tools import agent_tokenizer
from rlstage.engines.data import datasets, dynamic_sampling
from rlstage.engines.data.cursor import extra_prompt_batch, prompt_batch
from rlstage.engines.experience import BYPASS_CHECK_ROWS  # noqa: F401  (tests read it here)
from rlstage.engines.models import chat
from rlstage.engines.plugins import load_plugins
from rlstage.engines.registry import needs_of
from rlstage.engines.rewards import reward_model
from rlstage.engines.rewards import rules as rewards
from rlstage.engines.rollout.base import Completion, SamplingParams
from rlstage.infra.drill import fault_point, hold_point
from rlstage.infra.ray_runtime import get_unless_stopping
from rlstage.schemas import artifacts as A
from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import (
    AdvantageInputs,
    ConfigView,
    CriticInputs,
    EvalInputs,
    FilterGroupsInputs,
    RewardInputs,
    RolloutInputs,
    StageInputs,
    StageSpec,
    UpdateInputs,
    spec,
    stage_view,
    whole_config,
)
from rlstage.tasks.runtime import code_version, stage_config_hash, stage_key, store_for
from rlstage.workers.group import PolicyGroup, open_group
from rlstage.workers.roles import Trainer


@dataclass
class StageResult:
    manifest: Manifest
    executed: bool
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)


@dataclass
class StageOutput:
    tables: dict[str, pa.Table] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    # Set when a worker holds files to commit (a checkpoint): it writes them to the store itself, given
    # ArtifactStore.commit's keyword arguments and the tables; returns the manifest.
    commit_in_worker: Callable[[dict, dict[str, pa.Table]], Manifest] | None = None


def run_stage(
    cfg: ConfigView,
    stage: str,
    iteration: int | None,
    inputs: dict[str, str],
    produce: Callable[[], StageOutput],
    run: str | None = None,
    version: str = "main",
    meta: dict | None = None,
) -> StageResult:
    """Skip if committed with the same key; else produce and commit (manifest last).

    ``version`` other than "main" writes a sibling artifact (a replay), never the original.
    """
    store = store_for(cfg)
    run = run or cfg.run_name
    config_hash = stage_config_hash(cfg, stage)
    key = stage_key(stage, inputs, config_hash)
    existing = store.committed(run, iteration, stage, key, version=version)
    if existing is not None:
        return StageResult(existing, executed=False, metrics=existing.meta.get("metrics", {}))
    t0 = time.perf_counter()
    out = produce()
    seconds = time.perf_counter() - t0
    fault_point(cfg, stage, iteration)
    commit = {
        "run": run,
        "iteration": iteration,
        "stage": stage,
        "key": key,
        "config_hash": config_hash,
        "code_version": code_version(),
        "inputs": inputs,
        "meta": {**out.meta, **(meta or {}), "metrics": out.metrics, "compute_s": seconds},
        "version": version,
    }
    if out.commit_in_worker is not None:
        manifest = out.commit_in_worker(commit, out.tables)
    else:
        drill = functools.partial(fault_point, cfg, stage, iteration, where="kill_in_commit")
        manifest = store.commit(**commit, tables=out.tables, blobs=out.blobs, before_manifest=drill)
    return StageResult(manifest, executed=True, seconds=seconds, metrics=out.metrics)


# The Prefect task of each registry stage, by name (registered by ``stage_task``): its body runs in the
# calling process (replay, eval, data prep), or in a Ray worker with ON_RAY's (submit_stage's iterations).
TASKS: dict[str, Task] = {}
ON_RAY: dict[str, Task] = {}
BODIES: dict[str, Callable[..., StageOutput]] = {}


@dataclass(frozen=True)
class StageCall:
    """One call of a stage: what its task was given, as its body and cache key receive it."""

    stage: str
    iteration: int | None
    inputs: StageInputs
    version: str = "main"
    meta: dict | None = None
    options: dict = field(default_factory=dict)  # the body's own keyword options (the rollout's ``ahead``)


def execute(cfg: RunConfig, call: StageCall) -> StageResult:
    """Run ``call``'s stage on its config view: skipped when its output is committed under the same key (the
    stage's view and the ids of its inputs), else its body produces the output and it is committed."""
    s, view = spec(call.stage), stage_view(cfg, call.stage, needs_of)
    body = BODIES[call.stage]
    if s.per_iteration:
        produce = functools.partial(body, view, call.iteration, call.inputs, call.version, **call.options)
    else:
        produce = functools.partial(body, view)
    run = s.run_of(view) if s.run_of is not None else None
    return run_stage(view, call.stage, call.iteration, call.inputs.key(view), produce, run=run, version=call.version, meta=call.meta)


@ray.remote(max_retries=0)  # a lost worker fails the Prefect task, whose retry (visible in Prefect) runs it again
def _stage_process(cfg: RunConfig, call: StageCall) -> StageResult:
    load_plugins(cfg.plugins)  # this worker process registers what the run's plugins register
    return execute(cfg, call)


def _run_on_ray(cfg: RunConfig, call: StageCall) -> StageResult:
    """Run ``call`` in a Ray worker with the stage's resources; its own exception is raised here as it was raised
    there (its one-line message, the retry condition's type)."""
    res = cfg.ray.resources(call.stage)
    ref = _stage_process.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus).remote(cfg, call)
    try:
        return get_unless_stopping(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, Exception):
            raise err.cause from None
        raise


LOG_META = "log"  # manifest meta: lines a stage's workers logged (agent.function's failures and refused requests)


def _task_signature(s: StageSpec, body: Callable) -> inspect.Signature:
    """A stage task's parameters, from its spec: the run config, the iteration, each input by keyword (an optional
    one defaults to None), ``version``, ``meta``, then the body's own keyword options."""
    P = inspect.Parameter
    params = [P("cfg", P.POSITIONAL_OR_KEYWORD, annotation=RunConfig)]
    if s.per_iteration:
        params.append(P("iteration", P.POSITIONAL_OR_KEYWORD, annotation=int))
    for f in dataclasses.fields(s.takes):
        default = None if f.default is None else P.empty
        params.append(P(f.name, P.KEYWORD_ONLY, default=default, annotation=f.type))
    params += [P("version", P.KEYWORD_ONLY, default="main", annotation=str), P("meta", P.KEYWORD_ONLY, default=None)]
    params += [p for p in inspect.signature(body).parameters.values() if p.kind is P.KEYWORD_ONLY]
    return inspect.Signature(params)


def stage_task(name: str) -> Callable[[Callable[..., StageOutput]], Task]:
    """Register ``body`` as the task of registry stage ``name``. A per-iteration stage's body is called as
    ``body(view, iteration, inputs, version, **options)`` with its spec's input record, a run's preparation
    stage's as ``body(view)``; it returns what to commit, and is called only when nothing is committed under
    the stage's key. The task's parameters are derived from the spec (``_task_signature``)."""
    s = spec(name)  # a task for an undeclared stage fails at import

    def register(body: Callable[..., StageOutput]) -> Task:
        signature = _task_signature(s, body)

        def as_task(run_call: Callable[[RunConfig, StageCall], StageResult]) -> Task:
            def run(cfg: RunConfig, iteration: int | None = None, **kwargs) -> StageResult | State:
                given = {k: kwargs.pop(k) for k in s.inputs if k in kwargs}
                version, meta = kwargs.pop("version", "main"), kwargs.pop("meta", None)
                # what is left are the body's own options: an unknown one fails at the body's call
                call = StageCall(name, iteration, s.takes(**given), version, meta, kwargs)
                result = run_call(cfg, call)
                if result.executed:  # what the stage's workers had to say, in the task run's log (one line each)
                    _log_lines(name, result.manifest.meta.get(LOG_META) or [])
                return result if result.executed else cached(result)

            run.__signature__ = signature  # Prefect binds the task's parameters by it
            run.__name__, run.__doc__, run.__module__ = body.__name__, body.__doc__, body.__module__
            run.__qualname__ = body.__qualname__
            # The store's manifest decides reuse (run_stage); Prefect only reports it, so it caches nothing itself.
            return task(name=name, cache_policy=NO_CACHE, persist_result=False)(run)

        BODIES[name] = body
        TASKS[name] = as_task(execute)
        ON_RAY[name] = as_task(_run_on_ray)
        return TASKS[name]

    return register


def _log_lines(stage: str, lines: list[str]) -> None:
    try:
        logger = get_run_logger()
    except MissingContextError:  # the task's function called outside a task run
        logger = logging.getLogger(f"rlstage.stages.{stage}")
    for line in lines:
        logger.warning(line)


def cached(result: StageResult) -> State:
    """A reused stage's task run ends as Prefect's Cached state (Completed, named "Cached"), keyed by the
    stage's own cache key: a task that returns a state ends in it, and its result is the state's data."""
    return Completed(
        name="Cached",
        data=result,
        message=f"committed artifact {result.manifest.artifact_id} reused",
        state_details=StateDetails(cache_key=result.manifest.key),
    )


def result_of(returned: StageResult | State) -> StageResult:
    """What a stage task's function or call returned, as a StageResult (a reused stage returns its Cached state)."""
    return returned.result() if isinstance(returned, State) else returned


# ---------------------------------------------------------------- data prep
@stage_task("data_prep")
def data_prep(cfg: ConfigView) -> StageOutput:
    d = cfg.data
    if datasets.uses_kit(d.source):
        train, test = datasets.make_task_splits(
            cfg.kit.task, cfg.kit.digits, cfg.kit.train_size, cfg.kit.test_size, cfg.kit.seed
        )
    else:
        train, test = datasets.prepare_splits(d.source, d.train_path, d.test_path, d.source_settings)
    # As verl's filter_overlong_prompts (or its default, an error): in the policy's rendered prompt tokens.
    tok = agent_tokenizer(cfg)
    refuse = not d.filter_overlong_prompts
    where = {s: datasets.split_label(d.source, p, s) if refuse else None for s, p in (("train", d.train_path), ("test", d.test_path))}
    train, train_dropped = datasets.drop_overlong(train, tok, d.max_prompt_length, where["train"])
    test, test_dropped = datasets.drop_overlong(test, tok, d.max_prompt_length, where["test"])
    return StageOutput(
        tables={"train.parquet": train, "test.parquet": test},
        metrics={
            "data/train_prompts": train.num_rows,
            "data/test_prompts": test.num_rows,
            "data/train_dropped_overlong": train_dropped,
            "data/test_dropped_overlong": test_dropped,
        },
    )


def _read(cfg: ConfigView, manifest: Manifest, name: str) -> pa.Table:
    return store_for(cfg).read_table(manifest, name)


def _sampling(cfg: ConfigView, iteration: int, n: int | None = None, greedy: bool = False, round_: int = 0) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.n if n is None else n,
        temperature=0.0 if greedy else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        # dynamic sampling's extra rounds (round_ >= 1) draw apart from every iteration's first round
        seed=r.seed * 100_003 + iteration + round_ * 1_000_003,
    )


# ---------------------------------------------------------------- rollout
def prompts_per_round(cfg: ConfigView) -> int:
    """Prompts a generation round draws: verl's data.gen_batch_size, by default the trained batch's prompts."""
    return cfg.data.gen_batch_size or cfg.data.prompts_per_iteration


@stage_task("rollout")
def rollout(cfg: ConfigView, iteration: int, x: RolloutInputs, version: str, *, ahead: bool = False) -> StageOutput:
    """``ahead``: submitted by a pipelined run while the trainer trains the previous iteration; it then asks
    nothing of the trainer (the weights come from the store), so it computes beside the update."""
    train = _read(cfg, x.prompts, "train.parquet")
    rows = prompt_batch(train.num_rows, iteration, prompts_per_round(cfg), cfg.data.shuffle_seed)
    return generate_round(cfg, iteration, train.take(rows).to_pylist(), x.policy, version, ahead=ahead)


def generate_round(
    cfg: ConfigView,
    iteration: int,
    batch: list[dict],
    policy: PolicyRef,
    version: str = "main",
    round_: int = 0,
    ahead: bool = False,
) -> StageOutput:
    """One generation round over prompts-table rows: the rollout stage's (round 0), or one of dynamic sampling's."""
    group = open_group(cfg, version)
    group.arm("rollout", iteration)
    group.acquire_rollout(policy, update_hash(cfg), ask_trainer=not ahead)
    comps, stats = _complete(cfg, group, policy.version, batch, _sampling(cfg, iteration, round_=round_))
    log = stats.pop("log", [])  # agent.function: its failures and refused requests, for the stage's log
    if cfg.algorithm.adv_estimator.name == "remax":
        # ReMax's baseline: one greedy answer per prompt, scored like the samples (sample_index -1).
        greedy, _ = _complete(cfg, group, policy.version, batch, _sampling(cfg, iteration, n=1, greedy=True, round_=round_))
        comps += [replace(c, sample_index=-1) for c in greedy]
    out = tables.rollouts(batch, comps, iteration, round_, prompts_per_round(cfg))
    # Multi-turn: turns, tool calls and their failures, model vs tool time (the stage's own lengths win).
    agent = agent_metrics([c for c in comps if c.sample_index >= 0], stats) if cfg.agent.enable else {}
    meta = {"generated_by": group.generator_info(), **({LOG_META: log} if log else {})}
    return StageOutput(tables=out.tables, meta=meta, metrics={**agent, **out.metrics})


def _complete(cfg: ConfigView, group: PolicyGroup, version: str, batch: list[dict], params: SamplingParams) -> tuple[list[Completion], dict]:
    """Completions of prompts-table rows: single-turn, or multi-turn tool-calling rollouts (agent.enable)."""
    if cfg.agent.enable:
        return group.agent_generate(version, batch, params)
    # Chat messages through the policy's chat template (verl's way); plain-text rows as they stand.
    prompt_ids = chat.render_batch(agent_tokenizer(cfg), batch)
    return group.generate_ids(version, prompt_ids, params), {}


# ---------------------------------------------------------------- reward
def score_rows(cfg: ConfigView, rows: list[dict]) -> list:
    results = rewards.score_batch(
        rows,
        timeout_s=cfg.reward.timeout_s,
        function=cfg.reward.function,
        gsm8k_method=cfg.reward.gsm8k_method,
        format_score=cfg.reward.format_score,
        by_data_source=cfg.reward.by_data_source,
    )
    rewards.check_failures(results, cfg.reward.stop_failure_share)  # a broken reward function is not a 0.0 reward
    return results


def rule_results(cfg: ConfigView, rows: list[dict], wanted: list[bool]) -> dict:
    """The rule's result of each row that ``wanted`` marks, by row index (the rows an agent function scored itself,
    which may have no rule at all, are left out by their callers)."""
    ruled = [i for i, w in enumerate(wanted) if w]
    return dict(zip(ruled, score_rows(cfg, [rows[i] for i in ruled]) if ruled else [], strict=True))


def rm_scores(cfg: ConfigView, prompts: list[str], responses: list[str]) -> list[rewards.RewardResult]:
    """The reward model's score of each sample: the model's worker, or the configured HTTP server."""
    rm = cfg.reward_model
    if rm.server.url is not None:
        srv = rm.server
        if srv.api == "openai_chat":
            source = "reward_model.judge"
            got = reward_model.Judge(
                srv.url, srv.model, srv.judge_prompt, srv.score_scale, srv.max_tokens, srv.timeout_s, srv.concurrency,
                api_key=os.environ.get(srv.api_key_env) if srv.api_key_env else None,
            ).scores(prompts, responses)  # fmt: skip
        else:
            source = "reward_model.server"
            got = reward_model.score_server(srv.url, prompts, responses, timeout_s=srv.timeout_s, batch_size=srv.batch_size)
        results = [rewards.RewardResult(g.score, source, g.error) for g in got]
        rewards.check_failures(results, cfg.reward.stop_failure_share)
        return results
    from rlstage.workers.reward_model import open_reward_model

    # A failed batch raises here: the stage fails (retriable) and commits nothing.
    scores = ray.get(open_reward_model(cfg).score.remote(prompts, responses))
    return [rewards.RewardResult(s, "reward_model") for s in scores]


def score_round(cfg: ConfigView, table: pa.Table) -> StageOutput:
    """The rewards of one generation round's rollouts: the reward stage's, or one of dynamic sampling's."""
    rows = table.select(["response_text", "ground_truth", "data_source", "extra_info"]).to_pylist()
    r, rm_on = cfg.reward, cfg.reward_model.enable
    # A row whose agent function gave its own reward needs no rule (an OpenEnv episode has none); with a reward model,
    # neither does a row whose source has no rule. Rollouts stored before agent rewards have no column.
    given = table.column("agent_reward").to_pylist() if "agent_reward" in table.column_names else [None] * len(rows)
    wanted = [g is None and (not rm_on or rewards.has_rule(row["data_source"], r.function, r.by_data_source)) for g, row in zip(given, rows, strict=True)]
    ruled = rule_results(cfg, rows, wanted)
    rm = rm_scores(cfg, table.column("prompt").to_pylist(), [row["response_text"] for row in rows]) if rm_on else None
    ob, overlong = r.overlong_buffer, None
    if ob.enable:  # DAPO's, measured against the longest response a rollout can produce
        longest = cfg.agent.max_response_tokens if cfg.agent.enable else cfg.rollout.max_new_tokens
        overlong = tables.Overlong(ob.len, ob.penalty_factor, longest)
    out = tables.rewards(table, given, ruled, rm, cfg.reward_model.combine if rm_on else None, overlong)
    return StageOutput(tables=out.tables, metrics=out.metrics)


@stage_task("reward")
def reward(cfg: ConfigView, iteration: int, x: RewardInputs, version: str) -> StageOutput:
    return score_round(cfg, _read(cfg, x.rollouts, "rollouts.parquet"))


# ---------------------------------------------------------------- filter_groups (DAPO dynamic sampling)
@stage_task("filter_groups")
def filter_groups(cfg: ConfigView, iteration: int, x: FilterGroupsInputs, version: str) -> StageOutput:
    """Drop the groups without signal from the rollout and reward stages' round, generate and score further
    rounds of ``data.gen_batch_size`` prompts until ``data.prompts_per_iteration`` groups have signal, and commit the trimmed batch
    (which the later stages read in place of the rollouts and rewards) with every round's groups and verdicts."""
    fg, per_round = cfg.algorithm.filter_groups, prompts_per_round(cfg)
    train = _read(cfg, x.prompts, "train.parquet")
    generated_by: list[dict] = []

    def extra_round(round_: int) -> dynamic_sampling.GenRound:
        rows = extra_prompt_batch(train.num_rows, iteration, round_, per_round, cfg.data.shuffle_seed, fg.max_num_gen_batches)
        gen = generate_round(cfg, iteration, train.take(rows).to_pylist(), x.policy, version, round_)
        generated_by.append(gen.meta["generated_by"])
        table = gen.tables["rollouts.parquet"]
        return dynamic_sampling.GenRound(table, score_round(cfg, table).tables["rewards.parquet"])

    first = dynamic_sampling.GenRound(_read(cfg, x.rollouts, "rollouts.parquet"), _read(cfg, x.rewards, "rewards.parquet"))
    sel = dynamic_sampling.select_groups(first, extra_round, cfg.data.prompts_per_iteration, fg.max_num_gen_batches, fg.metric)
    extra = sel.rounds[1:]
    return StageOutput(
        tables={
            "groups.parquet": sel.groups,
            "rollouts.parquet": sel.rollouts,
            "rewards.parquet": sel.rewards,
            "extra_rollouts.parquet": pa.concat_tables([r.rollouts for r in extra]) if extra else first.rollouts.slice(0, 0),
            "extra_rewards.parquet": pa.concat_tables([r.rewards for r in extra]) if extra else first.rewards.slice(0, 0),
        },
        metrics=sel.metrics(),
        meta={"generated_by": generated_by} if generated_by else {},
    )


# ---------------------------------------------------------------- advantage
def _forwards(
    cfg: ConfigView, group: PolicyGroup, samples: experience.Samples, policy: PolicyRef, ref: PolicyRef | None, critic: PolicyRef | None
) -> experience.Forwards:
    """The workers' forwards on the samples' tokens: old log-probs (and sum pi^2), reference log-probs, values."""
    prompt_ids, response_ids = samples.column("prompt_ids"), samples.column("response_ids")
    temp = cfg.rollout.temperature
    a = cfg.algorithm
    sum_pi_sq = None
    if experience.needs_sum_pi_squared(a.adv_estimator) and cfg.actor.calculate_sum_pi_squared:
        # sum pi^2 needs every row's forward, which gives the old log-probs too (under bypass as well: the
        # update still trains against the rollout's, and the gap guard sees every row)
        checked = list(range(len(prompt_ids)))
        old, sum_pi_sq = group.call(Trainer.log_probs_and_sum_pi_squared, policy.version, prompt_ids, response_ids, temp)
    elif a.rollout_correction.bypass_mode:
        # verl's bypass: the sampler held exactly the trained weights, so its log-probs are the old ones
        checked = experience.bypass_rows(len(prompt_ids))
        sample = group.call(Trainer.log_probs, policy.version, [prompt_ids[i] for i in checked], [response_ids[i] for i in checked], temp)
        old = [list(r) for r in samples.column("rollout_log_probs")]
        for i, row in zip(checked, sample, strict=True):
            old[i] = row
    else:
        checked = list(range(len(prompt_ids)))
        old = group.call(Trainer.log_probs, policy.version, prompt_ids, response_ids, temp)
    fwd = experience.Forwards(old, checked, sum_pi_sq)
    if ref is not None:
        group.acquire(ref, role="ref")
        fwd.ref_log_probs = group.call(Trainer.ref_log_probs, ref.version, prompt_ids, response_ids, temp, role="ref")
    if critic is not None:
        hold_critic(group, cfg, critic)
        fwd.values = group.call(Trainer.values, critic.version, prompt_ids, response_ids, role="critic")
    return fwd


@stage_task("advantage")
def advantage(cfg: ConfigView, iteration: int, x: AdvantageInputs, version: str) -> StageOutput:
    """Old log-probs, optional ref log-probs / values / KL-in-reward, then the advantage estimator."""
    samples = experience.line_up(_read(cfg, x.rollouts, "rollouts.parquet"), _read(cfg, x.rewards, "rewards.parquet"))
    group = open_group(cfg, version)
    group.arm("advantage", iteration)
    hold_policy(group, cfg, x.policy)
    fwd = _forwards(cfg, group, samples, x.policy, x.ref, x.critic)
    exp = experience.compute_experience(
        samples,
        fwd,
        cfg.algorithm,
        kl_state=x.prev_experience.meta.get("kl_ctrl") if x.prev_experience is not None else None,
        off_policy=x.rollouts.inputs.get("policy") != x.policy.version,
        max_logprob_gap=cfg.rollout.max_logprob_gap,
        engine=cfg.rollout.engine,
        iteration=iteration,
    )
    served = {role: group.role_info(role) for role, held in (("ref", x.ref), ("critic", x.critic)) if held is not None}
    meta = {"served_on": served} if served else {}
    if exp.kl_state is not None:
        meta["kl_ctrl"] = exp.kl_state
    return StageOutput(tables={"experience.parquet": exp.table}, metrics=exp.metrics, meta=meta)


# ---------------------------------------------------------------- critic
@stage_task("critic")
def critic_update(cfg: ConfigView, iteration: int, x: CriticInputs, version: str) -> StageOutput:
    """Fit the value model to this iteration's returns; the worker commits the new critic checkpoint."""
    group = open_group(cfg, version)
    hold_critic(group, cfg, x.critic)
    metrics = group.call(Trainer.critic_update, x.critic.version, x.experience.model_dump(mode="json"), iteration, role="critic")
    return StageOutput(
        tables={"metrics.parquet": A.metrics_table(metrics)},
        metrics=metrics,
        # critic_ref: what a pruned critic is rebuilt from
        meta={"critic_ref": x.critic.model_dump(mode="json"), "trained_on": group.role_info("critic")},
        commit_in_worker=lambda commit, tables: group.commit("critic", commit, tables),
    )


# ---------------------------------------------------------------- update
def is_checkpoint(cfg: ConfigView, iteration: int) -> bool:
    return iteration % cfg.trainer.checkpoint_every == 0


def update_hash(cfg: ConfigView) -> str:
    """The update settings a policy committed between checkpoints must have been trained with to be rebuilt
    (by re-running its updates from stored experience): the update stage's view."""
    return stage_config_hash(whole_config(cfg), "update")


def hold_policy(group: PolicyGroup, cfg: ConfigView, ref: PolicyRef) -> None:
    """Make the trainer hold policy ``ref`` (rebuilt in the worker when it lies between checkpoints)."""
    group.acquire(ref, "policy", update_hash=update_hash(cfg))


def hold_critic(group: PolicyGroup, cfg: ConfigView, ref: PolicyRef) -> None:
    """Make the actor serving the critic (rank 0, or the reference/critic actor placed apart) hold critic
    ``ref``, rebuilt there when retention pruned its weights: valid under the critic stage's settings only."""
    group.acquire(ref, "critic", update_hash=stage_config_hash(whole_config(cfg), "critic"))


@stage_task("update")
def update(cfg: ConfigView, iteration: int, x: UpdateInputs, version: str) -> StageOutput:
    group = open_group(cfg, version)
    hold_policy(group, cfg, x.policy)
    checkpoint = is_checkpoint(cfg, iteration)
    # The worker reads the experience itself; between checkpoints only the metrics are stored.
    metrics = group.update(x.policy.version, x.experience, iteration, checkpoint)
    return StageOutput(
        tables={"metrics.parquet": A.metrics_table(metrics)},
        metrics=metrics,
        meta={
            "policy_ref": x.policy.model_dump(mode="json"),
            "between_checkpoints": not checkpoint,
            "trained_on": group.query_all(Trainer.info),
        },
        commit_in_worker=lambda commit, tables: group.commit("policy", commit, tables),
    )


# ---------------------------------------------------------------- eval
@stage_task("eval")
def evaluate(cfg: ConfigView, iteration: int, x: EvalInputs, version: str) -> StageOutput:
    prompts, policy = x.prompts, x.policy
    hold_point(cfg, f"eval:{iteration}")
    test = _read(cfg, prompts, "test.parquet")
    if cfg.data.eval_size is not None:
        test = test.slice(0, cfg.data.eval_size)
    batch = test.to_pylist()
    group = open_group(cfg, version)
    group.arm("eval", iteration)
    group.acquire_rollout(policy, update_hash(cfg))
    comps, stats = _complete(cfg, group, policy.version, batch, _sampling(cfg, iteration, n=1, greedy=True))
    log = stats.pop("log", [])  # agent.function: its failures and refused requests, for the stage's log
    # Tool use of the greedy answers (agent mode): held-out tool-call success rate and friends.
    agent = agent_metrics(comps, stats, prefix="val/") if cfg.agent.enable else {}
    if cfg.trainer.eval_n > 0:
        params = _sampling(cfg, iteration, n=cfg.trainer.eval_n)
        sampled, sampled_stats = _complete(cfg, group, policy.version, batch, params)
        comps += sampled
        log += sampled_stats.get("log", [])
    rows = rewards.completion_rows(batch, comps)
    # An agent function's own reward (agent.function) is the sample's score, as in the reward stage: the rule
    # scores only the rows without one.
    scores = [c.agent_reward if isinstance(c, AgentCompletion) else None for c in comps]
    correct_at: list[float | None] = [None] * len(comps)  # each rule's own bar for a correct answer
    for i, r in rule_results(cfg, rows, [sc is None for sc in scores]).items():
        scores[i], correct_at[i] = r.score, rewards.correct_at(r.reward_fn)
    correct = [eval_metrics.is_correct(s, c) for s, c in zip(scores, correct_at, strict=True)]
    greedy_n = len(batch)
    fns = [cfg.reward.function or rewards.default_reward_fn(row["data_source"], cfg.reward.by_data_source) for row in rows[greedy_n:]]
    uids = [c.prompt_index for c in comps[greedy_n:]]
    maj = cfg.trainer.eval_n > 0 and cfg.trainer.eval_require_maj
    metrics = {**agent, **eval_metrics.held_out_metrics(rows, scores, correct, greedy_n, uids, fns, require_maj=maj)}
    table = tables.eval_table(batch, comps, scores, greedy_n)
    return StageOutput(tables={"eval.parquet": table}, metrics=metrics, meta={LOG_META: log} if log else {})


def _retryable(task, task_run, state) -> bool:
    """A reward function that failed a batch fails it again, dynamic sampling short of groups at its cap (its
    rounds are seeded) would be again, and so would bad data: retries are for lost workers and stores."""
    return not isinstance(state.data, rewards.RewardFailure | dynamic_sampling.DynamicSamplingExhausted | datasets.DatasetError)


@functools.cache
def _configured(stage: str, on_ray: bool, retries: int, retry_delay_s: float) -> Task:
    # Task.with_options copies the task (~6 ms): once per setting, not once per stage run.
    task_ = (ON_RAY if on_ray else TASKS)[stage]
    return task_.with_options(retries=retries, retry_delay_seconds=retry_delay_s, retry_condition_fn=_retryable)


def submit_stage(cfg: RunConfig, stage: str, *args, on_ray: bool = True, **kwargs):
    """Submit stage ``stage``'s registered task with the retries configured for it; with ``on_ray`` its body
    runs in a Ray worker with the stage's Ray resources, else in this process (a thread of the flow)."""
    res = cfg.ray.resources(stage)
    return _configured(stage, on_ray, res.retries, res.retry_delay_s).submit(cfg, *args, **kwargs)
