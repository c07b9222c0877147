"""The handle stage tasks and flows use to reach a run's policy roles on Ray.

One owner for which weights a role holds: ``acquire(ref)`` makes a role hold exactly the version a
stage asks for (or raises before anything is computed) and ``commit`` writes a role's new checkpoint
from the worker straight to the store. Rank 0 holds every colocated role (policy with its optimizer and
rollout engine, reference, critic); with ``ray.trainer_world_size`` N > 1, ranks 1..N-1 are trainer-only
actors that load and train the policy in the same DeepSpeed process group. The rollout role
(``ray.rollout_placement``) and the reference with the critic (``ray.ref_critic_placement``) may each have
an actor of their own instead of rank 0. A flow owns the actors for its
lifetime (``open_group`` ... ``release``); a replay or eval gets actors of its own (its ``version`` is in
their names), so it never relabels the weights of a run that is training, started only when its stage computes
(``held_groups``).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorUnavailableError
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlstage.engines.rollout.base import Completion, SamplingParams
from rlstage.engines.rollout.engines import engine_traits
from rlstage.infra.ray_runtime import CLUSTER_LOST, RAY_NAMESPACE
from rlstage.infra.store import store_identity
from rlstage.schemas.config import ConfigError, RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.schemas.stages import ConfigView, whole_config
from rlstage.workers import pool
from rlstage.workers.policy import CRITIC_INIT, PolicyWorker, every_rank_generates
from rlstage.workers.roles import Generator, Trainer, Worker, method_name
from rlstage.workers.rollout import RolloutWorker

if TYPE_CHECKING:
    from rlstage.engines.agents.loop import AgentCompletion

RESTART_WAIT_S = 120.0  # how long a call waits for Ray to restart a killed worker (7-19 s seen on 2 cores)


def total_update_steps(cfg: RunConfig) -> int:
    samples = cfg.data.prompts_per_iteration * cfg.rollout.n
    per_iter = -(-samples // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
    return max(1, per_iter * max(1, cfg.trainer.iterations))


def actor_name(run: str, store_root: str, version: str = "main", rank: int = 0) -> str:
    # A run is its store and its name: runs of one name in two stores on one cluster get their own workers.
    store = hashlib.sha256(store_identity(store_root).encode()).hexdigest()[:8]
    base = f"policy-{run}-{store}" if version == "main" else f"policy-{run}-{store}@{version}"
    return base if rank == 0 else f"{base}-rank{rank}"


def _wait_restart(fn):
    """Run ``fn`` (a ``ray.get``); a worker Ray is restarting is waited for, not raced."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:
            return fn()
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass
class PolicyGroup:
    """A run's policy roles: ``ranks[0]`` holds them all, ``ranks[1:]`` are extra data-parallel trainers."""

    ranks: list[Any]
    name: str
    # the rollout role's actors when placed apart (ray.rollout_placement: separate, ray.rollout_num_workers)
    rollouts: list[Any] = field(default_factory=list)
    drills: bool = False  # drill.kill_worker_at names points: stages arm the actors
    ref_critic: Any = None  # the reference's and critic's actor when placed apart (ray.ref_critic_placement)
    hf_batch: int = 0  # the HF engine's batch in samples (0: an engine seeding each prompt): a split lands on its bounds
    # role -> its placement group ("trainer", "rollout", "ref_critic": the roles that ask for GPUs), removed on release
    placements: dict[str, Any] = field(default_factory=dict)
    ranks_generate: bool = False  # colocated generation split over every rank (workers.policy.every_rank_generates)
    # warm actors (workers/pool.py): their own Ray names by role (None: actors named after this group)
    warm_names: dict[str, list[str]] | None = None
    warm_keys: dict[str, str] = field(default_factory=dict)  # each warm actor's build (pool.worker_key)
    idle_s: float = 0.0  # how long released warm actors wait for the next run (ray.warm_worker_idle_s)

    @property
    def actors(self) -> list[Any]:
        return self.ranks + self.rollouts + ([self.ref_critic] if self.ref_critic is not None else [])

    def _serving(self, role: str) -> Any:
        """The actor holding ``role``: the reference and critic may have one of their own, the rest is rank 0."""
        return self.ref_critic if role in ("ref", "critic") and self.ref_critic is not None else self.ranks[0]

    @property
    def generators(self) -> list[Any]:
        """The actors that generate: the rollout role's own when placed apart, else the trainer ranks."""
        return self.rollouts or self.ranks

    def arm(self, stage: str, iteration: int) -> None:
        """Failure drills only: tell the actors that serve ``stage`` which stage and iteration their next calls
        serve: the generators for rollout and eval, the others for the rest. Never an actor busy with another
        stage: a pipelined rollout runs beside the update (the trainer's calls), the advantage beside it."""
        if self.drills:
            generate = stage in ("rollout", "eval")
            targets = self.generators if generate else self.ranks + ([self.ref_critic] if self.ref_critic is not None else [])
            _wait_restart(lambda: ray.get([a.arm.remote(stage, iteration) for a in targets]))

    def call(self, method: Callable[..., Any], *args: Any, role: str = "policy") -> Any:
        """One call of a role's ``method`` (``Trainer.log_probs``) on the actor that holds ``role``: rank 0 (the
        policy and every colocated role), or the reference and critic's own actor when they are placed apart."""
        actor, name = self._serving(role), method_name(method)
        return _wait_restart(lambda: ray.get(getattr(actor, name).remote(*args)))

    def role_info(self, role: str) -> dict:
        """Where ``role`` is served (recorded in the manifests of the stages it served)."""
        return self.call(Trainer.info, role=role)

    def query_all(self, method: Callable[..., Any], *args: Any) -> list:
        """A query on every rank (no collective inside): restarting ranks are waited for."""
        name = method_name(method)
        return _wait_restart(lambda: ray.get([getattr(r, name).remote(*args) for r in self.ranks]))

    def call_all(self, method: Callable[..., Any], *args: Any) -> list:
        """The same collective call on every rank at once; results in rank order.

        When one rank fails, every rank is restarted and the error raised (no retry here): the others would
        wait in a collective for the lost one (gloo's timeout is 30 min). The stage's retry then finds
        fresh ranks, which join a new process group and load the policy from the store.
        """
        name = method_name(method)
        futures = [getattr(r, name).remote(*args) for r in self.ranks]
        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception:
                if len(self.ranks) > 1:
                    for r in self.ranks:
                        ray.kill(r, no_restart=False)
                raise
        return ray.get(futures)

    def acquire(self, ref: PolicyRef, role: str = "policy", update_hash: str | None = None) -> str:
        args = (ref.model_dump(mode="json"), role, update_hash)
        if role != "policy" or len(self.ranks) == 1:
            return self.call(Trainer.acquire, *args, role=role)
        if all(v == ref.version for v in self.query_all(Trainer.version)):
            return ref.version
        # Some rank lacks it (a restart, a resume): every rank joins a new process group and loads it.
        addr, port = self.call(Trainer.rendezvous)
        self.call_all(Trainer.join, addr, port)
        return self.call_all(Trainer.acquire, *args)[0]

    def acquire_rollout(self, ref: PolicyRef, update_hash: str | None = None, ask_trainer: bool = True) -> None:
        """Make the generating role hold ``ref``: rank 0 when colocated, else every rollout actor, which the trainer
        pushes ``ref`` to in memory when it holds it (or rebuilds it: a version between checkpoints) and which
        reads the store or ``ref``'s path otherwise. ``ask_trainer=False`` (a pipelined rollout, submitted while the
        trainer trains) reads the store at once: a call of the trainer's would queue behind the running update, and
        the overlap would be lost. A rollout actor killed mid-push fails the stage, whose retry pushes again."""
        if not self.rollouts:
            self.acquire(ref, "policy", update_hash)
            return
        versions = _wait_restart(lambda: ray.get([a.version.remote() for a in self.rollouts]))
        behind = [(a, v) for a, v in zip(self.rollouts, versions, strict=True) if v != ref.version]
        if not behind:
            return
        ref_json = ref.model_dump(mode="json")
        if not (ask_trainer and self.call(Trainer.serves_weights, ref_json)):
            _wait_restart(lambda: ray.get([a.acquire.remote(ref_json) for a, _ in behind]))
            return
        self.acquire(ref, "policy", update_hash)  # held: nothing to do; between checkpoints: rebuilt
        for have in dict.fromkeys(v for _, v in behind):  # a delta per version held (a restarted actor: whole)
            actors = [a for a, v in behind if v == have]
            plan, first, last = self.call(Trainer.push_start, ref.version, have), True, False
            while not last:  # bucket by bucket: one in the object store at a time, whatever the model's size
                bucket = self.ranks[0].push_bucket.remote()
                last = ray.get([a.receive.remote(plan if first else None, bucket) for a in actors])[0]
                first = False
            ray.get([a.receive_commit.remote(ref_json) for a in actors])

    def generate_ids(self, version: str, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of rendered prompts on the role that generates. Over several rollout actors, or over the
        trainer ranks when each generates (``ranks_generate``), the prompts are split in contiguous shares, each
        sampled with its global prompt indices (``first_prompt``), so the completions equal one actor's, in the same
        order."""
        generators = self.rollouts or (self.ranks if self.ranks_generate else [])
        if not generators:
            return self.call(Generator.generate_ids, version, prompt_ids, params)
        shares = self._shares(len(prompt_ids), params.n, len(generators)) if prompt_ids else [(0, 0)]
        actors = generators[: len(shares)]

        def calls() -> list:  # submitted again on each try: a restarted actor needs a new call, not the failed one
            return [
                a.generate_ids.remote(version, prompt_ids[lo:hi], replace(params, first_prompt=lo))
                for a, (lo, hi) in zip(actors, shares, strict=True)
            ]

        return [c for part in _wait_restart(lambda: ray.get(calls())) for c in part]

    def agent_generate(self, version: str, rows: list[dict], params: SamplingParams) -> tuple[list[AgentCompletion], dict]:
        """Multi-turn rollouts of prompts-table rows and their stats, all on one actor (the first rollout actor, else
        rank 0): its agent loop batches every row's turns together."""
        if not self.rollouts:
            return self.call(Generator.agent_generate, version, rows, params)
        return _wait_restart(lambda: ray.get(self.rollouts[0].agent_generate.remote(version, rows, params)))

    def _shares(self, prompts: int, n: int, actors: int) -> list[tuple[int, int]]:
        """Contiguous prompt ranges, one per generating actor, cut at the HF engine's batch bounds."""
        unit = self.hf_batch // math.gcd(self.hf_batch, n) if self.hf_batch else 1  # prompts a batch bound falls on
        blocks = -(-prompts // unit)
        per = -(-blocks // actors)
        return [(lo, min(lo + per * unit, prompts)) for lo in range(0, prompts, per * unit)]

    def generator_info(self) -> dict:
        """Where generation ran and how its weights arrived."""
        if not self.rollouts:
            return {"placement": "colocated", **self.call(Trainer.info), **({"ranks": len(self.ranks)} if self.ranks_generate else {})}
        infos = ray.get([a.info.remote() for a in self.rollouts])
        return {"placement": "separate", **infos[0], **({"workers": infos} if len(infos) > 1 else {})}

    def update(self, version: str, experience: Manifest, iteration: int, checkpoint: bool) -> dict:
        """Every rank trains its slice of each mini-batch; metrics are the ranks' means (rank 0 reports)."""
        return self.call_all(Trainer.update, version, experience.model_dump(mode="json"), iteration, checkpoint)[0]

    def commit(self, role: str, commit: dict, tables: dict) -> Manifest:
        """Each other rank writes its optimizer partition (ZeRO 1-3) into the artifact, then rank 0 writes the
        weights and its state and commits them all; the other ranks name their (identical) weights alike."""
        written: dict = {}
        if role == "policy" and len(self.ranks) > 1:
            for files in _wait_restart(lambda: ray.get([r.commit_shard.remote(commit) for r in self.ranks[1:]])):
                written.update(files)
        manifest = Manifest.model_validate(self.call(Trainer.commit, role, commit, tables, written, role=role))
        if role == "policy" and len(self.ranks) > 1:
            self.query_all(Trainer.adopt, manifest.artifact_id)  # a rank that lost them reloads at the next acquire
        return manifest

    def release(self, busy: bool = False) -> None:
        """Stop the workers: close engines and scratch folders first (vLLM leaves /dev/shm files when killed).
        ``busy`` (a stop mid-stage): a worker inside a call would only take ``close`` after it, so the workers
        are killed at once and the files their engines registered are removed here."""
        from rlstage.engines.rollout.vllm_engine import reap_owned_files

        if CLUSTER_LOST.is_set():  # each call would wait 60 s for a GCS that is gone, and its workers went with it
            return
        if self.warm_names is not None:
            pool.forget_group(self.name)
            if not busy and self._park():
                return
        pids = [pid for r in self.actors if (pid := _actor_pid(r)) is not None]
        for r in self.actors:
            if not busy:
                try:
                    ray.get(r.close.remote(), timeout=60)
                except Exception:  # a dead or hung worker still gets killed
                    pass
            ray.kill(r)
        for group in self.placements.values():
            remove_placement_group(group)
        reap_owned_files(pids, wait_s=30)


    def _park(self) -> bool:
        """Reset each warm actor and leave it idle in the cluster's pool (False: one failed; all are stopped)."""
        try:
            _wait_restart(lambda: ray.get([getattr(a, method_name(Worker.reset)).remote() for a in self.actors], timeout=60))
        except Exception:  # a dead or hung worker: the group is stopped as a cold one is
            return False
        names = [own for role in ("trainer", "rollout", "ref_critic") for own in self.warm_names[role]]
        for own, handle in zip(names, self.actors, strict=True):
            pool.park(self.warm_keys[own], own, handle, self.idle_s)
        return True


def _actor_pid(actor) -> int | None:
    """The process of a live actor on this node (None elsewhere, or when the state API does not say)."""
    try:
        info = ray._private.state.actors(actor_id=actor._actor_id.hex())
        local = info["Address"]["NodeID"] == ray.get_runtime_context().get_node_id()
        return int(info["Pid"]) if local and info.get("State") == "ALIVE" else None
    except Exception:  # a private API: without it, files of a killed worker wait for the next engine to reap them
        return None


@dataclass(frozen=True)
class RoleAsk:
    """What each actor of a role asks of Ray, and how many actors it has (0: served by trainer rank 0)."""

    prefix: str  # its settings are ray.<prefix>_num_cpus and ray.<prefix>_num_gpus
    cpus: float
    gpus: float
    custom_key: str  # ray.<custom_key>: the role's custom resources
    custom: dict[str, float]
    count: int


def role_asks(cfg: RunConfig) -> dict[str, RoleAsk]:
    """Each role's resources, declared once: the actors' Ray options, their placement groups' bundles and the
    check that the cluster can hold them all read this table."""
    r = cfg.ray
    return {
        "trainer": RoleAsk("worker", r.worker_num_cpus, r.worker_num_gpus, "trainer_resources", r.trainer_resources, r.trainer_world_size),
        "rollout": RoleAsk("rollout", r.rollout_num_cpus, r.rollout_num_gpus, "rollout_resources", r.rollout_resources, r.rollout_num_workers if r.rollout_placement == "separate" else 0),
        "ref_critic": RoleAsk("ref_critic", r.ref_critic_num_cpus, r.ref_critic_num_gpus, "ref_critic_resources", r.ref_critic_resources, 1 if r.ref_critic_placement == "separate" else 0),
    }  # fmt: skip


def check_placement(cfg: RunConfig) -> None:
    """Refuse, before any stage, a placement the Ray cluster cannot hold (Ray would wait forever)."""
    cluster = ray.cluster_resources()
    have = cluster.get("CPU", 0.0)
    asks = role_asks(cfg)
    trainer = asks["trainer"]
    apart = [a for role, a in asks.items() if role != "trainer" and a.count and a.cpus]
    stage = max([cfg.ray.resources(s).num_cpus for s in ("rollout", "advantage", "update", "eval")])
    tasks = "a stage task's"
    if cfg.trainer.async_staleness:
        # pipelined: the next rollout's task computes beside this iteration's reward, advantage or update task,
        # so both are reserved up front (else Ray would start the rollout only once the update ended)
        stage = cfg.ray.resources("rollout").num_cpus + max(cfg.ray.resources(s).num_cpus for s in ("reward", "advantage", "update"))
        tasks = "the pipelined rollout's task beside another stage task's"
    # idle warm workers hold resources: only those this run will take stay (workers/pool.py)
    pool.make_room(set(_warm_keys(cfg).values()) if pool.poolable(cfg) else set())
    need = sum(a.cpus * a.count for a in [trainer, *apart]) + stage
    if need > have:
        roles = "".join(f" + {f'{a.count} x ' if a.count > 1 else ''}ray.{a.prefix}_num_cpus={a.cpus:g}" for a in apart)
        raise ConfigError(
            f"config error: ray.trainer_world_size={trainer.count} x ray.worker_num_cpus={trainer.cpus:g}{roles} plus "
            f"{tasks} {stage:g} CPUs need {need:g} CPUs; the Ray cluster has {have:g}"
        )
    gpu_roles = [a for a in asks.values() if a.gpus and a.count]
    need_gpus = sum(a.gpus * a.count for a in gpu_roles)
    if need_gpus > cluster.get("GPU", 0.0):
        asked = " + ".join(f"{a.count} x ray.{a.prefix}_num_gpus={a.gpus:g}" for a in gpu_roles)
        raise ConfigError(f"config error: {asked} need {need_gpus:g} GPUs; the Ray cluster has {cluster.get('GPU', 0.0):g}")
    for a in asks.values():
        for name, amount in a.custom.items():
            if cluster.get(name, 0.0) < amount:
                raise ConfigError(f"config error: ray.{a.custom_key}.{name}={amount:g}: the Ray cluster has {cluster.get(name, 0.0):g} of it")


# The groups ``held_groups`` holds in this process, by name: None until a stage body opens it.
_HELD: dict[str, PolicyGroup | None] = {}
_HELD_LOCK = threading.Lock()


@contextmanager
def held_groups(cfg: RunConfig | ConfigView, version: str) -> Iterator[None]:
    """For a flow whose stage bodies run in this process (replay, eval): the groups they open under ``version``
    are started on first use, kept for the rest of the block (later stages find the same actors) and released at
    its end. A stage already committed, or one that needs no policy (reward), starts no worker (~6 s of imports
    each)."""
    cfg = whole_config(cfg)
    name = actor_name(cfg.run_name, cfg.store.root, version)
    with _HELD_LOCK:
        if name in _HELD:
            raise RuntimeError(f"{name}: its group is held already")
        _HELD[name] = None
    try:
        yield
    finally:
        with _HELD_LOCK:
            group = _HELD.pop(name)
        if group is not None:
            group.release()


def open_group(cfg: RunConfig | ConfigView, version: str = "main") -> PolicyGroup:
    """The run's policy workers, created on first use (the flow keeps the handles: the actors live as long).

    Started from the whole config: what a worker reads for each stage is declared in that stage's view.
    """
    cfg = whole_config(cfg)
    name = actor_name(cfg.run_name, cfg.store.root, version)
    with _HELD_LOCK:
        if (group := _HELD.get(name)) is None:
            group = _open_group(cfg, version, name)
            if name in _HELD:
                _HELD[name] = group
    return group


def _open_group(cfg: RunConfig, version: str, name: str) -> PolicyGroup:
    """The actors of group ``name`` (``actor_name``: rank 0's): found when they run already (under the group's
    own names, or as warm actors whose names the pool recorded), else warm ones taken from the cluster's pool,
    else started."""
    common = {"namespace": RAY_NAMESPACE, "max_restarts": -1, "max_task_retries": 0}
    cfg_json = cfg.model_dump(mode="json")
    asks = role_asks(cfg)
    # a hold point naming a role ("rollout@rollout:2") is announced from the worker too, as kill points are
    drills = bool(cfg.drill.kill_worker_at) or any("@" in p for p in cfg.drill.hold_worker_at)
    # vLLM seeds each prompt: any split samples alike; HF seeds each batch of rollout.batch_size samples
    hf_batch = cfg.rollout.batch_size if engine_traits(cfg.rollout.engine).seeds_per_batch else 0
    ranks_generate = every_rank_generates(cfg) and asks["trainer"].count > 1
    if (warm := pool.group_names(name)) is not None:  # a stage task finding the warm actors its flow bound
        try:
            found = {role: [pool.get_actor(n) for n in names] for role, names in warm.items()}
        except ValueError:  # recorded by a process that died before releasing them: gone with it
            pool.forget_group(name)
        else:
            ref_critic = found["ref_critic"][0] if found["ref_critic"] else None
            return PolicyGroup(found["trainer"], name, found["rollout"], drills, ref_critic, hf_batch, {}, ranks_generate, warm)
    placements = {
        role: _role_bundles(cfg, version, role, {"CPU": a.cpus, "GPU": a.gpus, **a.custom}, a.count)
        for role, a in asks.items()
        if a.count and a.gpus > 0
    }

    def options(role: str, index: int) -> dict:
        """Ray options of a role's ``index``-th actor: its resources, inside its bundle when the role has a group."""
        a, group = asks[role], placements.get(role)
        placed = {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)} if group else {}
        return {"num_cpus": a.cpus, "num_gpus": a.gpus, "resources": dict(a.custom), **placed, **common}

    steps = total_update_steps(cfg)
    # (role, index, worker class, its constructor's arguments, the name it has when started for this group)
    wanted = [
        *[("trainer", r, PolicyWorker, (cfg_json, steps, r, asks["trainer"].count), actor_name(cfg.run_name, cfg.store.root, version, r)) for r in range(asks["trainer"].count)],
        *[("rollout", i, RolloutWorker, (cfg_json,), name + "-rollout" + (f"{i}" if i else "")) for i in range(asks["rollout"].count)],
        # a worker of the trainer's kind that never acquires the policy: it holds only the reference and critic
        *[("ref_critic", 0, PolicyWorker, (cfg_json, steps), name + "-ref-critic") for _ in range(asks["ref_critic"].count)],
    ]  # fmt: skip
    actors: dict[str, list] = {"trainer": [], "rollout": [], "ref_critic": []}
    if not pool.poolable(cfg):
        pool.make_room()  # idle workers hold resources these need
        for role, i, cls, args, own in wanted:
            actors[role].append(ray.remote(cls).options(name=own, get_if_exists=True, **options(role, i)).remote(*args))
        pool.note_bound(name, len(wanted))
        return PolicyGroup(actors["trainer"], name, actors["rollout"], drills, actors["ref_critic"][0] if actors["ref_critic"] else None, hf_batch, placements, ranks_generate)
    names: dict[str, list[str]] = {"trainer": [], "rollout": [], "ref_critic": []}
    keys: dict[str, str] = {}
    keys_by_role = _warm_keys(cfg)
    taken = [(spec, pool.take(keys_by_role[spec[0]])) for spec in wanted]
    mine = {w.name for _, w in taken if w is not None}
    why = {spec[0]: pool.why_fresh(keys_by_role[spec[0]], mine) for spec, w in taken if w is None}
    if why:
        pool.make_room()  # idle workers of other builds hold resources the fresh ones need
    # on a cluster that outlives the command its warm actors outlive it too, for the next command to take
    lifetime = {"lifetime": "detached"} if pool.outlives_command(cfg) else {}
    try:
        for (role, i, cls, args, _), w in taken:
            if w is None:
                pool.say(f"{name} starts a fresh {role} worker: {why[role]}")
                own = pool.fresh_name(keys_by_role[role])
                pool.bind_record(own, args)
                handle = ray.remote(cls).options(name=own, **lifetime, **options(role, i)).remote(*args)
            else:
                own, handle = w.name, w.handle
                pool.bind_record(own, args)  # before the call: a restart while binding comes back bound to this run
                actors[role].append(handle)  # stopped below if binding fails
                _wait_restart(lambda h=handle, a=args: ray.get(h.bind.remote(*a)))
                actors[role].pop()
                pool.say(f"{name} reuses warm {role} worker {own}")
            actors[role].append(handle)
            names[role].append(own)
            keys[own] = keys_by_role[role]
    except BaseException:  # none of them may be left holding resources, idle or bound
        for handle in [h for hs in actors.values() for h in hs] + [w.handle for _, w in taken if w is not None]:
            ray.kill(handle)
        raise
    pool.record_group(name, names)
    pool.note_bound(name, len(wanted))
    ref_critic = actors["ref_critic"][0] if actors["ref_critic"] else None
    group = PolicyGroup(actors["trainer"], name, actors["rollout"], drills, ref_critic, hf_batch, placements, ranks_generate, names)
    group.warm_keys, group.idle_s = keys, cfg.ray.warm_worker_idle_s
    return group


def _warm_keys(cfg: RunConfig) -> dict[str, str]:
    """Each role's warm-worker build (``pool.worker_key``): what an idle worker must have been built for."""
    return {
        role: pool.worker_key(cfg, role, {"num_cpus": a.cpus, "num_gpus": a.gpus, "resources": a.custom})
        for role, a in role_asks(cfg).items()
    }


def _role_bundles(cfg: RunConfig, version: str, role: str, bundle: dict[str, float], count: int):
    """A role's placement group (verl's resource pool) when it asks for GPUs: one bundle of CPUs, GPUs and custom
    resources per actor, packed onto as few nodes as possible (a data-parallel group shares a node's GPU
    interconnect when it fits). Named after the run: a stage task's ``open_group`` finds the one its flow made."""
    name = f"{actor_name(cfg.run_name, cfg.store.root, version)}-{role}"
    try:
        return get_placement_group(name)
    except ValueError:  # none yet
        pass
    bundle = {k: v for k, v in bundle.items() if v}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK", name=name)
    ray.get(group.ready(), timeout=RESTART_WAIT_S)
    return group


def critic_init_ref(policy: PolicyRef) -> PolicyRef:
    """The critic's starting point: the initial policy's weights with a fresh value head."""
    return policy.model_copy(update={"version": CRITIC_INIT + policy.version})
