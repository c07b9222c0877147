"""Warm role workers: the actors a run released, kept idle on the Ray cluster for the next compatible run.

A role actor's start costs seconds of a Ray worker's boot and imports (torch, transformers, the run's plugins)
before it loads any weights. When a group is released (``PolicyGroup.release``) each of its actors drops
every weight, engine and scratch folder it held (``reset``) and waits, keyed by what its process was built for
(``worker_key``); the next group of a compatible role takes it (``take``) and binds it to its own run (``bind``),
then loads the policy from the store as a restarted worker does. Nothing of one run reaches another: the key holds
the code version, the model, the engines and the resources, and the run's config, store and drills arrive with
``bind``.

The pool lives in Ray's key-value store, so it is the cluster's, not one process's: on a cluster that outlives the
command (``ray.address``: ``ray start`` elsewhere, a stack's Ray) warm actors are detached, and a later command takes
the workers an earlier one released. Entries (namespace ``rlstage-warm``):

- ``idle:<key>:<name>``: actor ``name`` waits, built for ``key``;
- ``claim:<name>``: the job that holds it (a run bound to it, or a stop under way): written only if absent, so two
  commands never take the same worker, and an idle worker that stops itself never stops one a run just took;
- ``<name>``: the arguments it was bound with last, read back if Ray restarts it;
- ``group:<group>``: a group's actor names and its job (stage tasks find the flow's warm actors by it).

An idle actor stops itself after ``ray.warm_worker_idle_s`` unless claimed (``Parkable``). A command killed while
its workers are bound leaves them claimed by a dead job: the next group that opens on the cluster stops them
(``reap_orphans``). Idle actors hold their Ray resources: a group that needs a worker the pool does not have first
stops every idle one of another build (``make_room``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.experimental import internal_kv

from rlstage.engines.rollout.engines import engine_traits
from rlstage.infra.ray_runtime import RAY_NAMESPACE, cluster_address
from rlstage.schemas.config import RunConfig

# What a worker's process is built for, beyond the code and its resources: the model it loads and its dtype and
# threads, the engines it imports and starts (vLLM's settings shape its engine process), the plugins it loaded and
# the agent code it imports. Everything else (LoRA, batch sizes, seeds, losses) arrives with each run's bind.
BUILD = (
    "model.path", "model.dtype", "model.torch_threads", "rollout.engine", "rollout.vllm", "actor.engine",
    "actor.zero_stage", "plugins", "agent.function", "agent.tools",
)  # fmt: skip
_KV = "rlstage-warm"  # the key-value namespace of the pool's entries
_IDLE, _CLAIM, _GROUP = "idle:", "claim:", "group:"
_PACKAGE = Path(__file__).resolve().parent.parent
_SUBPACKAGES = ("schemas", "engines", "workers", "tasks", "flows", "infra")  # never a checkout's .venv or tests


@functools.cache
def code_version() -> str:
    """A digest of rlstage's own source as this process imported it (names, sizes and modification times of the
    modules of its sub-packages): a worker started from other code is never reused."""
    h = hashlib.sha256()
    paths = [_PACKAGE / "__init__.py", *(p for sub in _SUBPACKAGES for p in sorted((_PACKAGE / sub).rglob("*.py")))]
    for path in paths:
        st = path.stat()
        h.update(f"{path.relative_to(_PACKAGE)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def poolable(cfg: RunConfig) -> bool:
    """Whether this run's workers may be warm ones: not under failure drills (kills and restarts keep cold
    workers), not placed on GPUs by groups, and generating with an in-memory engine such as HF's (a vLLM engine, with
    its KV cache and parallel state, is started anew). Data-parallel ranks are: a released rank leaves its process
    group, and the next group's ranks join a new one before they load the policy, as after a restart."""
    if not engine_traits(cfg.rollout.engine).in_memory:
        return False
    r = cfg.ray
    gpus = r.worker_num_gpus or (r.rollout_num_gpus and r.rollout_placement == "separate") or (
        r.ref_critic_num_gpus and r.ref_critic_placement == "separate"
    )  # fmt: skip
    drills = cfg.drill.kill_worker_at or cfg.drill.hold_worker_at or cfg.drill.kill_in_commit
    return r.warm_worker_idle_s > 0 and not gpus and not drills


def outlives_command(cfg: RunConfig) -> bool:
    """Whether the run's Ray cluster outlives the command (one it joined: ``ray.address``, a stack's): its warm
    actors are then detached, to serve a later command; on the command's own local Ray they end with it."""
    return bool(cluster_address(cfg))


def worker_key(cfg: RunConfig, role: str, resources: dict) -> str:
    """What a worker's process was built for: the code, the role, the settings of ``BUILD`` and its Ray resources."""
    parts = {"code": code_version(), "role": role, "build": cfg.stage_hash(*BUILD), "resources": resources}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Warm:
    key: str
    name: str  # the actor's own Ray name
    handle: Any


_BOUND: dict[str, int] = {}  # group name -> workers bound to it in this process (fresh or warm)
# Handles of the idle actors this process parked: an actor that is not detached ends with its last handle.
_PARKED: dict[str, Any] = {}


# ---------------------------------------------------------------- the key-value store
def _put(key: str, value: str, overwrite: bool = True) -> bool:
    """Write an entry; False where ``overwrite`` is off and the entry was there already."""
    return not internal_kv._internal_kv_put(key, value, overwrite=overwrite, namespace=_KV) or overwrite


def _get(key: str) -> str | None:
    raw = internal_kv._internal_kv_get(key, namespace=_KV)
    return raw.decode() if raw else None


def _delete(key: str) -> None:
    internal_kv._internal_kv_del(key, namespace=_KV)


def _keys(prefix: str) -> list[str]:
    if not internal_kv._internal_kv_initialized():  # no Ray yet in this process: no pool either
        return []
    return sorted(k.decode() for k in internal_kv._internal_kv_list(prefix, namespace=_KV))


def _job() -> str:
    return ray.get_runtime_context().get_job_id()


def _dead_jobs() -> set[str]:
    """The Ray jobs of the cluster that have ended (a command's driver that exited, or was killed)."""
    return {j["JobID"] for j in ray._private.state.jobs() if j.get("IsDead")}


def _claim(name: str, key: str) -> bool:
    """Hold worker ``name`` for this job (False: another holds it)."""
    return _put(_CLAIM + name, json.dumps({"job": _job(), "key": key}), overwrite=False)


def say(line: str) -> None:
    """A line of the pool's choices, printed at ``--verbose``."""
    if os.environ.get("RLSTAGE_VERBOSE", "") not in ("", "0"):
        print(f"rlstage: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- taking, parking and stopping workers
def fresh_name(key: str) -> str:
    """A Ray name of its own for a new warm-capable actor, claimed by this job from the start (the group's names are
    looked up in the key-value store)."""
    name = f"rlstage-warm-{uuid.uuid4().hex[:12]}"
    _claim(name, key)
    return name


def take(key: str) -> Warm | None:
    """An idle worker built for ``key``, now claimed by this job and off the idle list (None: the cluster has none)."""
    for entry in _keys(_IDLE + key + ":"):
        name = entry.rsplit(":", 1)[1]
        if not _claim(name, key):
            continue  # taken by another command, or stopping itself, since the listing
        _delete(entry)
        try:
            return Warm(key, name, _PARKED.pop(name, None) or get_actor(name))
        except ValueError:  # its process went (a node lost)
            _forget(name)
    return None


def why_fresh(key: str, mine: set[str]) -> str:
    """Why no worker of build ``key`` was idle (``mine``: the workers this group took): a line for ``--verbose``."""
    idle = _keys(_IDLE)
    busy = [n for n in (e[len(_CLAIM) :] for e in _keys(_CLAIM)) if n not in mine and json.loads(_get(_CLAIM + n) or "{}").get("key") == key]
    if busy:
        return f"{len(busy)} worker(s) of its build are busy in other runs"
    if idle:
        return f"{len(idle)} idle worker(s) are of another build (code version, model, engines or resources)"
    return "no idle worker on the cluster"


def make_room(keep: set[str] = frozenset()) -> None:
    """Stop every idle worker not built for one of ``keep`` (a run about to start needs the resources they hold), and
    the workers of commands that died holding them (``reap_orphans``)."""
    reap_orphans()
    stopped = 0
    for entry in _keys(_IDLE):
        _, key, name = entry.split(":", 2)
        if key not in keep and _claim(name, key):
            _delete(entry)
            _stop(name)
            stopped += 1
    if stopped:
        say(f"stopped {stopped} idle worker(s) of other builds: the run needs the resources they hold")


def reap_orphans() -> list[str]:
    """Stop the warm workers held by jobs that ended without releasing them (a command killed mid-run): on a cluster
    that outlives commands they would hold their resources, bound to a run nobody continues. Their names."""
    claims = {entry[len(_CLAIM) :]: _get(entry) for entry in _keys(_CLAIM)}
    if not claims:
        return []
    dead = _dead_jobs()
    orphans = [name for name, raw in claims.items() if raw and json.loads(raw)["job"] in dead]
    for name in orphans:
        _stop(name)
    for entry in _keys(_GROUP):
        if (raw := _get(entry)) and json.loads(raw).get("job") in dead:
            _delete(entry)
    if orphans:
        say(f"stopped {len(orphans)} warm worker(s) of a command that ended without releasing them")
    return orphans


def park(key: str, name: str, handle: Any, idle_s: float) -> None:
    """Leave a released (reset) worker idle: the next run of its build takes it, or it stops itself after
    ``idle_s`` seconds."""
    _PARKED[name] = handle
    _put(f"{_IDLE}{key}:{name}", json.dumps({"job": _job()}))
    _delete(_CLAIM + name)
    handle.idle.remote(key, idle_s)


def _forget(name: str) -> None:
    _PARKED.pop(name, None)
    for entry in _keys(_IDLE):
        if entry.endswith(":" + name):
            _delete(entry)
    _delete(name)
    _delete(_CLAIM + name)


def _stop(name: str) -> None:
    try:
        ray.kill(_PARKED.get(name) or get_actor(name))
    except Exception:  # gone already, or a Ray already shut down took the actor with it
        pass
    _forget(name)


def idle_count() -> int:
    """Idle workers on the cluster (every command's)."""
    return len(_keys(_IDLE))


class Parkable:
    """Mixed into a warm-capable worker: parked, it stops itself after its idle time unless a run claimed it."""

    _idle_turn = 0  # which parking the pending timer belongs to: a timer of an earlier one does nothing

    def idle(self, key: str, seconds: float) -> None:
        self._idle_turn += 1
        me, turn = ray.get_runtime_context().current_actor, self._idle_turn
        timer = threading.Timer(seconds, lambda: me.expire.remote(key, turn))
        timer.daemon = True
        timer.start()

    def expire(self, key: str, turn: int) -> None:
        name = ray.get_runtime_context().get_actor_name()
        if turn != self._idle_turn or not _claim(name, key):
            return  # parked again since, or a run took it
        _forget(name)
        ray.actor.exit_actor()


# ---------------------------------------------------------------- names and bindings in Ray's key-value store
def bind_record(name: str, args: tuple) -> None:
    """Record what warm actor ``name`` serves now (its constructor's arguments), read back on a restart."""
    _put(name, json.dumps(args))


def binding(name: str | None) -> tuple | None:
    """The arguments warm actor ``name`` was last bound with (None: not a warm actor, or never rebound)."""
    if not name or not internal_kv._internal_kv_initialized():
        return None
    raw = _get(name)
    return tuple(json.loads(raw)) if raw else None


def record_group(group: str, names: dict[str, list[str]]) -> None:
    _put(_GROUP + group, json.dumps({"job": _job(), "roles": names}))


def forget_group(group: str) -> None:
    _delete(_GROUP + group)


def group_names(group: str) -> dict[str, list[str]] | None:
    """The actor names of a group whose actors are warm ones, bound by a job that still runs (None: the group's actors
    bear its own names, or the command that bound them is gone)."""
    raw = _get(_GROUP + group)
    if raw is None:
        return None
    record = json.loads(raw)
    if record["job"] != _job() and record["job"] in _dead_jobs():
        reap_orphans()
        return None
    return record["roles"]


def get_actor(name: str) -> Any:
    return ray.get_actor(name, namespace=RAY_NAMESPACE)


def bound_count(group: str) -> int:
    """How many workers groups named ``group`` were given in this process (warm or fresh): tests count the
    workers a replay or eval started by it."""
    return _BOUND.get(group, 0)


def note_bound(group: str, n: int) -> None:
    _BOUND[group] = _BOUND.get(group, 0) + n
