"""Warm role workers: the actors a run released, kept idle in this process for the next compatible run.

A role actor's start costs seconds of a Ray worker's boot and imports (torch, transformers, the run's plugins)
before it loads any weights. When a group is released (``PolicyGroup.release``) each of its actors drops
every weight, engine and scratch folder it held (``reset``) and waits here, keyed by what its process was
built for (``worker_key``); the next group of a compatible role takes it (``take``) and binds it to its own
run (``bind``), then loads the policy from the store as a restarted worker does. Nothing of one run reaches
another: the key holds the code version, the model, the engines and the resources, and the run's config,
store and drills arrive with ``bind``.

A group's actors are found by the group's name (stage tasks run in other processes): a bound warm actor keeps
its own Ray name, so the group's names are written to Ray's key-value store, and so is each warm actor's
binding, which a restarted actor reads back (Ray restarts an actor with the arguments it was created with).

Idle actors hold their Ray resources: a group that needs a worker the pool does not have first stops every
idle one (``make_room``), and each is stopped after ``ray.warm_worker_idle_s`` seconds.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.experimental import internal_kv

from rlstage.engines.rollout.engines import engine_traits
from rlstage.infra.ray_runtime import RAY_NAMESPACE
from rlstage.schemas.config import RunConfig

# What a worker's process is built for, beyond the code and its resources: the model it loads and its dtype and
# threads, the engines it imports and starts (vLLM's settings shape its engine process), the plugins it loaded and
# the agent code it imports. Everything else (LoRA, batch sizes, seeds, losses) arrives with each run's bind.
BUILD = (
    "model.path", "model.dtype", "model.torch_threads", "rollout.engine", "rollout.vllm", "actor.engine",
    "actor.zero_stage", "plugins", "agent.function", "agent.tools",
)  # fmt: skip
_KV = "rlstage-warm"  # the key-value namespace of group names and bindings
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


def worker_key(cfg: RunConfig, role: str, resources: dict) -> str:
    """What a worker's process was built for: the code, the role, the settings of ``BUILD`` and its Ray resources."""
    parts = {"code": code_version(), "role": role, "build": cfg.stage_hash(*BUILD), "resources": resources}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(eq=False)  # an entry is itself: a worker parked again is a new entry, its old timer finds none
class Warm:
    key: str
    name: str  # the actor's own Ray name
    handle: Any


_IDLE: list[Warm] = []
_LOCK = threading.Lock()
_SESSION: list[str] = []  # the Ray session the idle handles belong to
_NAMES = itertools.count()
_BOUND: dict[str, int] = {}  # group name -> workers bound to it in this process (fresh or warm)


def _session() -> str:
    return ray.get_runtime_context().get_node_id() + ":" + str(ray.get_runtime_context().get_job_id())


def _forget_other_sessions() -> None:
    """Handles of an earlier Ray (shut down and started again in this process) are gone with it."""
    now = _session()
    if _SESSION != [now]:
        _IDLE.clear()
        _SESSION[:] = [now]


def fresh_name() -> str:
    """A Ray name of its own for a new warm-capable actor (the group's names are looked up in the KV store)."""
    return f"rlstage-warm-{os.getpid()}-{next(_NAMES)}"


def take(key: str) -> Warm | None:
    """An idle worker built for ``key``, now off the idle list (None: the pool has none)."""
    with _LOCK:
        _forget_other_sessions()
        for i, w in enumerate(_IDLE):
            if w.key == key:
                return _IDLE.pop(i)
    return None


def make_room(keep: set[str] = frozenset()) -> None:
    """Stop every idle worker not built for one of ``keep``: a run about to start needs the resources they hold."""
    with _LOCK:
        _forget_other_sessions()
        idle = [w for w in _IDLE if w.key not in keep]
        _IDLE[:] = [w for w in _IDLE if w.key in keep]
    for w in idle:
        _stop(w)


def park(key: str, name: str, handle: Any, idle_s: float) -> None:
    """Keep a released (reset) worker idle for ``idle_s`` seconds."""
    w = Warm(key, name, handle)
    with _LOCK:
        _forget_other_sessions()
        _IDLE.append(w)
    timer = threading.Timer(idle_s, _expire, args=(w,))
    timer.daemon = True
    timer.start()


def _expire(w: Warm) -> None:
    with _LOCK:
        if w not in _IDLE:
            return  # taken (or stopped) since
        _IDLE.remove(w)
    _stop(w)


def _stop(w: Warm) -> None:
    try:
        internal_kv._internal_kv_del(w.name, namespace=_KV)
        ray.kill(w.handle)
    except Exception:  # a Ray already shut down took the actor with it
        pass


def idle_count() -> int:
    with _LOCK:
        return len(_IDLE)


# ---------------------------------------------------------------- names and bindings in Ray's key-value store
def bind_record(name: str, args: tuple) -> None:
    """Record what warm actor ``name`` serves now (its constructor's arguments), read back on a restart."""
    internal_kv._internal_kv_put(name, json.dumps(args), overwrite=True, namespace=_KV)


def binding(name: str | None) -> tuple | None:
    """The arguments warm actor ``name`` was last bound with (None: not a warm actor, or never rebound)."""
    if not name or not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(name, namespace=_KV)
    return tuple(json.loads(raw)) if raw else None


def record_group(group: str, names: dict[str, list[str]]) -> None:
    internal_kv._internal_kv_put("group:" + group, json.dumps(names), overwrite=True, namespace=_KV)


def forget_group(group: str) -> None:
    internal_kv._internal_kv_del("group:" + group, namespace=_KV)


def group_names(group: str) -> dict[str, list[str]] | None:
    """The actor names of a group whose actors are warm ones (None: the group's actors bear its own names)."""
    raw = internal_kv._internal_kv_get("group:" + group, namespace=_KV)
    return json.loads(raw) if raw else None


def get_actor(name: str) -> Any:
    return ray.get_actor(name, namespace=RAY_NAMESPACE)


def bound_count(group: str) -> int:
    """How many workers groups named ``group`` were given in this process (warm or fresh): tests count the
    workers a replay or eval started by it."""
    return _BOUND.get(group, 0)


def note_bound(group: str, n: int) -> None:
    _BOUND[group] = _BOUND.get(group, 0) + n
