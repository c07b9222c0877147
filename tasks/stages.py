"""One Prefect task per stage: read input artifacts, call an engine, commit the output artifact.

Every stage is skipped when its output for the same inputs and config is already committed,
so rerunning an interrupted run continues where it stopped. Retries and Ray resources come from
``ray.stages.<stage>`` in the config (see ``submit_stage``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import ray
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from engines import algorithms as algos
from engines import datasets, rewards
from engines.agent_loop import agent_metrics
from engines.cursor import prompt_batch
from schemas import artifacts as A
from schemas.config import ConfigError, RunConfig
from schemas.manifest import Manifest, PolicyRef
from tasks.runtime import (
    STAGE_CONFIG,
    code_version,
    ensure_policy,
    policy_worker,
    stage_key,
    store_for,
)


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
    on_commit: Callable[[Manifest], None] | None = None


def run_stage(
    cfg: RunConfig,
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
    config_hash = cfg.stage_hash(*STAGE_CONFIG[stage])
    key = stage_key(stage, inputs, config_hash)
    existing = store.committed(run, iteration, stage, key, version=version)
    if existing is not None:
        return StageResult(existing, executed=False, metrics=existing.meta.get("metrics", {}))
    t0 = time.perf_counter()
    out = produce()
    seconds = time.perf_counter() - t0
    fault_point(cfg, stage, iteration)
    manifest = store.commit(
        run,
        iteration,
        stage,
        key=key,
        config_hash=config_hash,
        code_version=code_version(),
        inputs=inputs,
        tables=out.tables,
        blobs=out.blobs,
        meta={**out.meta, **(meta or {}), "metrics": out.metrics, "compute_s": seconds},
        version=version,
    )
    if out.on_commit is not None:
        out.on_commit(manifest)
    return StageResult(manifest, executed=True, seconds=seconds, metrics=out.metrics)


def fault_point(cfg: RunConfig, stage: str, iteration: int | None, where: str = "kill_at") -> None:
    """Failure drill: SIGKILL this process once at a point named in ``cfg.drill``.

    A marker file per point under ``drill.markers`` makes each fire once, so the retry that
    follows runs to completion.
    """
    point = f"{stage}:{iteration}"
    if not cfg.drill.markers or point not in getattr(cfg.drill, where):
        return
    try:
        fd = os.open(os.path.join(cfg.drill.markers, f"{where}-{stage}-{iteration}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _stage_task(name: str):
    return task(name=name, cache_policy=NO_CACHE, persist_result=False)


# ---------------------------------------------------------------- data prep
@_stage_task("data_prep")
def data_prep(cfg: RunConfig) -> StageResult:
    def produce() -> StageOutput:
        d = cfg.data
        if d.source == "synthetic":
            train, test = datasets.make_task_splits(
                cfg.kit.task, cfg.kit.digits, cfg.kit.train_size, cfg.kit.test_size, cfg.kit.seed
            )
        else:
            train = datasets.load_prompts(d.source, d.train_path)
            test = datasets.load_prompts(d.source, d.test_path) if d.test_path else train.slice(0, 0)
        return StageOutput(
            tables={"train.parquet": train, "test.parquet": test},
            metrics={"data/train_prompts": train.num_rows, "data/test_prompts": test.num_rows},
        )

    return run_stage(cfg, "data_prep", None, {}, produce)


def _read(cfg: RunConfig, manifest: Manifest, name: str) -> pa.Table:
    return store_for(cfg).read_table(manifest, name)


def _sampling(cfg: RunConfig, iteration: int, n: int | None = None, greedy: bool = False) -> dict:
    r = cfg.rollout
    return {
        "n": r.n if n is None else n,
        "temperature": 0.0 if greedy else r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
        "seed": r.seed * 100_003 + iteration,
    }


# ---------------------------------------------------------------- rollout
@_stage_task("rollout")
def rollout(
    cfg: RunConfig, iteration: int, prompts: Manifest, policy: PolicyRef, version: str = "main", meta: dict | None = None
) -> StageResult:
    def produce() -> StageOutput:
        train = _read(cfg, prompts, "train.parquet")
        rows = prompt_batch(train.num_rows, iteration, cfg.data.prompts_per_iteration, cfg.data.shuffle_seed)
        batch = train.take(rows).to_pylist()
        worker = policy_worker(cfg)
        hold_policy(worker, cfg, policy)
        comps, stats = _complete(cfg, worker, policy.version, batch, _sampling(cfg, iteration))
        if cfg.algorithm.adv_estimator == "remax":
            # ReMax's baseline: one greedy answer per prompt, scored like the samples (sample_index -1).
            greedy, _ = _complete(cfg, worker, policy.version, batch, _sampling(cfg, iteration, n=1, greedy=True))
            comps += [{**c, "sample_index": -1} for c in greedy]
        table = _rollouts_table(batch, comps, iteration)
        lengths = np.array(table.column("response_length").to_pylist())
        clipped = np.array([f == "length" for f in table.column("finish_reason").to_pylist()])
        # Multi-turn: turns, tool calls and their failures, model vs tool time (the stage's own lengths win).
        agent = agent_metrics([c for c in comps if c["sample_index"] >= 0], stats) if cfg.agent.enable else {}
        return StageOutput(
            tables={"rollouts.parquet": table},
            metrics={
                **agent,
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "response_length/min": float(lengths.min()),
                "response_length/clip_ratio": float(clipped.mean()),
                "prompt_length/mean": float(np.mean(table.column("prompt_length").to_pylist())),
                "rollout/tokens": float(lengths.sum() + np.sum(table.column("prompt_length").to_pylist())),
            },
        )

    inputs = {"prompts": prompts.artifact_id, "policy": policy.version}
    return run_stage(cfg, "rollout", iteration, inputs, produce, version=version, meta=meta)


def _complete(cfg: RunConfig, worker, version: str, batch: list[dict], params: dict) -> tuple[list[dict], dict]:
    """Completions of prompts-table rows: single-turn, or multi-turn tool-calling rollouts (agent.enable)."""
    if cfg.agent.enable:
        return ray.get(worker.agent_generate.remote(version, batch, params))
    return ray.get(worker.generate.remote(version, [p["prompt"] for p in batch], params)), {}


_AGENT_COLUMNS = ("turn_bounds", "truncated", "num_turns", "tool_calls", "tool_errors", "tool_timeouts")


def _rollouts_table(batch: list[dict], comps: list[dict], iteration: int) -> pa.Table:
    cols: dict[str, list] = {name: [] for name in A.ROLLOUTS.names}
    for c in comps:
        p = batch[c["prompt_index"]]
        k = c["sample_index"]
        cols["sample_id"].append(f"{p['prompt_id']}/{iteration}/{'greedy' if k < 0 else k}")
        cols["prompt_id"].append(p["prompt_id"])
        cols["group_id"].append(c["prompt_index"])
        cols["sample_index"].append(c["sample_index"])
        for k in ("prompt", "data_source", "ground_truth", "extra_info"):
            cols[k].append(p[k])
        cols["prompt_ids"].append(c["prompt_ids"])
        cols["response_ids"].append(c["response_ids"])
        cols["response_mask"].append(c.get("response_mask") or [1] * len(c["response_ids"]))
        cols["messages_json"].append(c.get("messages"))  # agent completions only, null otherwise
        for k in _AGENT_COLUMNS:
            cols[k].append(c.get(k))
        cols["response_text"].append(c["text"])
        cols["rollout_log_probs"].append(c["log_probs"])
        cols["finish_reason"].append(c["finish_reason"])
        cols["prompt_length"].append(len(c["prompt_ids"]))
        cols["response_length"].append(len(c["response_ids"]))
    return pa.table(cols, schema=A.ROLLOUTS)


# ---------------------------------------------------------------- reward
def score_rows(cfg: RunConfig, rows: list[dict]) -> list:
    results = rewards.score_batch(
        rows, timeout_s=cfg.reward.timeout_s, function=cfg.reward.function, gsm8k_method=cfg.reward.gsm8k_method
    )
    rewards.check_failures(results, cfg.reward.stop_failure_share)  # a broken reward function is not a 0.0 reward
    return results


@_stage_task("reward")
def reward(
    cfg: RunConfig, iteration: int, rollouts: Manifest, version: str = "main", meta: dict | None = None
) -> StageResult:
    def produce() -> StageOutput:
        table = _read(cfg, rollouts, "rollouts.parquet")
        rows = table.select(["response_text", "ground_truth", "data_source", "extra_info"]).to_pylist()
        results = score_rows(cfg, rows)
        all_scores = np.array([r.score for r in results], dtype=np.float64)
        scores = all_scores[np.array(table.column("sample_index").to_pylist()) >= 0]  # not ReMax baselines
        errors = [r.error for r in results]
        out = pa.table(
            {
                "sample_id": table.column("sample_id"),
                "score": pa.array(all_scores, pa.float32()),
                "reward_fn": [r.reward_fn for r in results],
                "error": errors,
            },
            schema=A.REWARDS,
        )
        return StageOutput(
            tables={"rewards.parquet": out},
            metrics={
                "critic/score/mean": float(scores.mean()),
                "critic/score/max": float(scores.max()),
                "critic/score/min": float(scores.min()),
                "reward/errors": float(sum(e is not None for e in errors)),
                "reward/timeouts": float(sum(e is not None and e.startswith("timeout") for e in errors)),
            },
        )

    return run_stage(cfg, "reward", iteration, {"rollouts": rollouts.artifact_id}, produce, version=version, meta=meta)


# ---------------------------------------------------------------- advantage
def _padded(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _unpad(t: torch.Tensor, lens: list[int]) -> list[list[float]]:
    return [t[i, :n].tolist() for i, n in enumerate(lens)]


@_stage_task("advantage")
def advantage(
    cfg: RunConfig,
    iteration: int,
    rollouts: Manifest,
    rewards_m: Manifest,
    policy: PolicyRef,
    ref: PolicyRef | None = None,
    critic: PolicyRef | None = None,
    prev: Manifest | None = None,
    version: str = "main",
    meta: dict | None = None,
) -> StageResult:
    """Old log-probs, optional ref log-probs / values / KL-in-reward, then the advantage estimator.

    ``ref`` is the frozen starting policy (KL), ``critic`` the value model (GAE), ``prev`` the
    previous iteration's experience, whose manifest carries the adaptive KL controller's state.
    """
    a = cfg.algorithm

    def produce() -> StageOutput:
        ro = _read(cfg, rollouts, "rollouts.parquet")
        rw = _read(cfg, rewards_m, "rewards.parquet")
        if ro.column("sample_id").to_pylist() != rw.column("sample_id").to_pylist():
            raise ValueError("rewards do not line up with rollouts (sample_id order differs)")
        all_scores = np.array(rw.column("score").to_pylist(), dtype=np.float32)
        is_sample = np.array(ro.column("sample_index").to_pylist()) >= 0
        groups = np.array(ro.column("group_id").to_pylist())
        baseline = dict(zip(groups[~is_sample].tolist(), all_scores[~is_sample].tolist(), strict=True))
        ro = ro.filter(pa.array(is_sample))
        scores = torch.from_numpy(all_scores[is_sample])
        index = groups[is_sample]
        prompt_ids = ro.column("prompt_ids").to_pylist()
        response_ids = ro.column("response_ids").to_pylist()
        masks = ro.column("response_mask").to_pylist()
        lens = [len(r) for r in response_ids]
        width = max(lens)
        mask = _padded(masks, width)
        worker = policy_worker(cfg)
        store = store_for(cfg)
        hold_policy(worker, cfg, policy)
        temp = cfg.rollout.temperature
        old = ray.get(worker.log_probs.remote(policy.version, prompt_ids, response_ids, temp))
        old_t = _padded(old, width)
        metrics: dict[str, float] = {}
        ref_lp = values = None
        if ref is not None:
            ensure_policy(worker, store, ref, role="ref")
            ref_lp = ray.get(worker.ref_log_probs.remote(ref.version, prompt_ids, response_ids, temp))
        if critic is not None:
            ensure_policy(worker, store, critic, role="critic")
            values = ray.get(worker.values.remote(critic.version, prompt_ids, response_ids))
        # Outcome reward sits on the last policy token of each response.
        token_scores = torch.zeros_like(mask)
        for i, m in enumerate(masks):
            last = max((j for j, v in enumerate(m) if v), default=None)
            if last is not None:
                token_scores[i, last] = scores[i]
        token_rewards = token_scores
        kl_state = None
        if a.use_kl_in_reward:
            ctrl = algos.get_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
            if prev is not None and "kl_ctrl" in prev.meta:
                ctrl.load_state_dict(prev.meta["kl_ctrl"])  # beta carries over between iterations
            token_rewards, kl_metrics = algos.apply_kl_penalty(
                token_scores, old_t, _padded(ref_lp, width), mask, ctrl, a.kl_penalty
            )
            metrics.update(kl_metrics)
            kl_state = ctrl.state_dict()
        adv, ret = algos.compute_advantage(
            a.adv_estimator,
            token_level_rewards=token_rewards,
            response_mask=mask,
            index=index,
            values=None if values is None else _padded(values, width),
            reward_baselines=torch.tensor([baseline.get(g, 0.0) for g in index.tolist()], dtype=torch.float32)
            if baseline
            else None,
            gamma=a.gamma,
            lam=a.lam,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
        )
        roll_lp = _padded(ro.column("rollout_log_probs").to_pylist(), width)
        list_type = A.EXPERIENCE.field("ref_log_probs").type
        table = pa.table(
            {
                "sample_id": ro.column("sample_id"),
                "group_id": ro.column("group_id"),
                "prompt_ids": ro.column("prompt_ids"),
                "response_ids": ro.column("response_ids"),
                "response_mask": ro.column("response_mask"),
                "score": pa.array(scores.numpy(), pa.float32()),
                "old_log_probs": old,
                "ref_log_probs": pa.nulls(len(lens), list_type) if ref_lp is None else ref_lp,
                "values": pa.nulls(len(lens), list_type) if values is None else values,
                "token_level_rewards": _unpad(token_rewards, lens),
                "advantages": _unpad(adv, lens),
                "returns": _unpad(ret, lens),
            },
            schema=A.EXPERIENCE,
        )
        valid = mask.bool()
        metrics.update(
            {
                "critic/advantages/mean": float(algos.masked_mean(adv, mask)),
                "critic/advantages/max": float(adv[valid].max()) if valid.any() else 0.0,
                "critic/advantages/min": float(adv[valid].min()) if valid.any() else 0.0,
                "critic/returns/mean": float(algos.masked_mean(ret, mask)),
                "critic/rewards/mean": float(token_rewards.sum(-1).mean()),
                "rollout/logprob_gap": float(algos.masked_mean((roll_lp - old_t).abs(), mask)),
            }
        )
        # The rollout engine sampled with other weights than the trainer holds (a missed or broken weight
        # sync): fail before anything trains on it.
        gap, bound = metrics["rollout/logprob_gap"], cfg.rollout.max_logprob_gap
        if bound is not None and not gap <= bound:
            raise RuntimeError(
                f"iteration {iteration}: rollout/logprob_gap {gap:.3g} > rollout.max_logprob_gap {bound:g}: the "
                f"{cfg.rollout.engine} rollout engine's log-probs differ from the trainer's recompute on the same tokens"
            )
        if ref_lp is not None:
            metrics["actor/ref_kl"] = float(algos.masked_mean(old_t - _padded(ref_lp, width), mask))
        if values is not None:
            metrics["critic/values/mean"] = float(algos.masked_mean(_padded(values, width), mask))
        if baseline:
            metrics["critic/baseline/mean"] = float(np.mean(list(baseline.values())))
        return StageOutput(
            tables={"experience.parquet": table}, metrics=metrics, meta={} if kl_state is None else {"kl_ctrl": kl_state}
        )

    inputs = {"rollouts": rollouts.artifact_id, "rewards": rewards_m.artifact_id, "policy": policy.version}
    inputs.update({k: v.version for k, v in (("ref", ref), ("critic", critic)) if v is not None})
    if prev is not None and a.use_kl_in_reward and a.kl_ctrl.type == "adaptive":
        inputs["prev_experience"] = prev.artifact_id
    return run_stage(cfg, "advantage", iteration, inputs, produce, version=version, meta=meta)


# ---------------------------------------------------------------- critic
@_stage_task("critic")
def critic_update(
    cfg: RunConfig, iteration: int, experience: Manifest, critic: PolicyRef, version: str = "main", meta: dict | None = None
) -> StageResult:
    """Fit the value model to this iteration's returns; commits the new critic checkpoint."""
    worker = policy_worker(cfg)

    def produce() -> StageOutput:
        exp = _read(cfg, experience, "experience.parquet")
        batch = {c: exp.column(c).to_pylist() for c in ("prompt_ids", "response_ids", "response_mask", "values", "returns")}
        ensure_policy(worker, store_for(cfg), critic, role="critic")
        seed = cfg.trainer.seed * 1_000_003 + iteration
        metrics, files = ray.get(worker.critic_update.remote(critic.version, batch, seed))
        return StageOutput(
            tables={"metrics.parquet": A.metrics_table(metrics)},
            blobs=files,
            metrics=metrics,
            on_commit=lambda m: ray.get(worker.set_version.remote(m.artifact_id, "critic")),
        )

    inputs = {"experience": experience.artifact_id, "critic": critic.version}
    return run_stage(cfg, "critic", iteration, inputs, produce, version=version, meta=meta)


# ---------------------------------------------------------------- update
def _update_args(cfg: RunConfig, iteration: int, experience: Manifest) -> tuple[dict, float, int, bool]:
    """The worker's ``update`` arguments for ``iteration``: batch, temperature, seed, critic warm-up skip."""
    exp = _read(cfg, experience, "experience.parquet")
    cols = ["prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages"]
    if cfg.actor.use_kl_loss:
        cols.append("ref_log_probs")
    batch = {c: exp.column(c).to_pylist() for c in cols}
    seed = cfg.trainer.seed * 1_000_003 + iteration
    skip = iteration <= cfg.critic.warmup_iterations and cfg.critic.enable  # critic warm-up
    return batch, cfg.rollout.temperature, seed, skip


def is_checkpoint(cfg: RunConfig, iteration: int) -> bool:
    return iteration % cfg.trainer.checkpoint_every == 0


def hold_policy(worker, cfg: RunConfig, ref: PolicyRef) -> None:
    """Make the worker hold policy ``ref``; one committed between checkpoints is rebuilt by
    re-running its update (and, recursively, the ones before it) from the stored experience."""
    store = store_for(cfg)
    if ray.get(worker.version.remote("policy")) == ref.version:
        return
    m = store.manifest(ref.run, ref.iteration, ref.stage) if ref.stage == "update" and ref.path is None else None
    if m is None or m.artifact_id != ref.version or not m.meta.get("between_checkpoints"):
        ensure_policy(worker, store, ref)
        return
    if m.config_hash != cfg.stage_hash(*STAGE_CONFIG["update"]):
        raise ConfigError(
            f"config error: the policy of iteration {m.iteration} lies between checkpoints "
            f"(trainer.checkpoint_every={cfg.trainer.checkpoint_every}) and was trained with other actor "
            "settings; replay from a checkpointed iteration or keep the actor settings"
        )
    previous = PolicyRef.model_validate(m.meta["policy_ref"])
    hold_policy(worker, cfg, previous)
    experience = store.manifest(m.run, m.iteration, "advantage")
    if experience is None or experience.artifact_id != m.inputs["experience"]:
        raise FileNotFoundError(f"experience {m.inputs['experience']} of iteration {m.iteration} is not committed")
    ray.get(worker.update.remote(previous.version, *_update_args(cfg, m.iteration, experience), checkpoint=False))
    ray.get(worker.set_version.remote(m.artifact_id))


@_stage_task("update")
def update(
    cfg: RunConfig, iteration: int, experience: Manifest, policy: PolicyRef, version: str = "main", meta: dict | None = None
) -> StageResult:
    worker = policy_worker(cfg)

    def produce() -> StageOutput:
        args = _update_args(cfg, iteration, experience)
        hold_policy(worker, cfg, policy)
        checkpoint = is_checkpoint(cfg, iteration)
        # Between checkpoints only the metrics are stored: the weights follow from the inputs.
        metrics, files = ray.get(worker.update.remote(policy.version, *args, checkpoint=checkpoint))
        return StageOutput(
            tables={"metrics.parquet": A.metrics_table(metrics)},
            blobs=files,
            metrics=metrics,
            meta={"policy_ref": policy.model_dump(mode="json"), "between_checkpoints": not checkpoint},
            # The worker already holds these weights: mark them as the committed version.
            on_commit=lambda m: ray.get(worker.set_version.remote(m.artifact_id)),
        )

    inputs = {"experience": experience.artifact_id, "policy": policy.version}
    return run_stage(cfg, "update", iteration, inputs, produce, version=version, meta=meta)


# ---------------------------------------------------------------- eval
@_stage_task("eval")
def evaluate(
    cfg: RunConfig, iteration: int, prompts: Manifest, policy: PolicyRef, version: str = "main", meta: dict | None = None
) -> StageResult:
    def produce() -> StageOutput:
        test = _read(cfg, prompts, "test.parquet")
        if cfg.data.eval_size is not None:
            test = test.slice(0, cfg.data.eval_size)
        batch = test.to_pylist()
        worker = policy_worker(cfg)
        hold_policy(worker, cfg, policy)
        comps, stats = _complete(cfg, worker, policy.version, batch, _sampling(cfg, iteration, n=1, greedy=True))
        # Tool use of the greedy answers (agent mode): held-out tool-call success rate and friends.
        agent = agent_metrics(comps, stats, prefix="val/") if cfg.agent.enable else {}
        if cfg.trainer.eval_n > 0:
            params = _sampling(cfg, iteration, n=cfg.trainer.eval_n)
            comps += _complete(cfg, worker, policy.version, batch, params)[0]
        rows = rewards.completion_rows(batch, comps)
        scores = [r.score for r in score_rows(cfg, rows)]
        greedy_n = len(batch)
        table = pa.table(
            {
                "prompt_id": [batch[c["prompt_index"]]["prompt_id"] for c in comps],
                "sample_index": [-1] * greedy_n + [c["sample_index"] for c in comps[greedy_n:]],
                "response_text": [c["text"] for c in comps],
                "score": pa.array(scores, pa.float32()),
            },
            schema=A.EVAL,
        )
        metrics: dict[str, float] = dict(agent)
        sources = [r["data_source"] for r in rows]
        for ds in sorted(set(sources)):
            g = [s for s, src in zip(scores[:greedy_n], sources[:greedy_n], strict=True) if src == ds]
            metrics[f"val-core/{ds}/reward/mean@1"] = float(np.mean(g))
            if cfg.trainer.eval_n > 0:
                sampled = [s for s, src in zip(scores[greedy_n:], sources[greedy_n:], strict=True) if src == ds]
                metrics[f"val-core/{ds}/reward/mean@{cfg.trainer.eval_n}"] = float(np.mean(sampled))
        metrics["val/accuracy"] = float(np.mean(scores[:greedy_n]))
        return StageOutput(tables={"eval.parquet": table}, metrics=metrics)

    inputs = {"prompts": prompts.artifact_id, "policy": policy.version}
    return run_stage(cfg, "eval", iteration, inputs, produce, version=version, meta=meta)


def _retryable(task, task_run, state) -> bool:
    """A reward function that failed a batch fails it again: retries are for lost workers and stores."""
    return not isinstance(state.data, rewards.RewardFailure)


def submit_stage(task_fn, cfg: RunConfig, stage: str, *args, **kwargs):
    """Submit a stage task with the retries and Ray resources configured for it."""
    from prefect_ray.context import remote_options

    res = cfg.ray.resources(stage)
    configured = task_fn.with_options(
        retries=res.retries, retry_delay_seconds=res.retry_delay_s, retry_condition_fn=_retryable
    )
    with remote_options(num_cpus=res.num_cpus, num_gpus=res.num_gpus):
        return configured.submit(cfg, *args, **kwargs)
