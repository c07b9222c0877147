"""Starting or joining Ray, bound to loopback when local."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import ray

from rlstage.infra.drill import hold_point
from rlstage.infra.env import apply_defaults, pid_running
from rlstage.schemas.config import RunConfig

RAY_NAMESPACE = "rlstage"
WORKERS_SOFT_LIMIT = 16  # idle workers kept: the role actors plus the stage tasks a schedule has in flight
# Set when a signal interrupts the flow's wait: stage tasks waiting on Ray in threads of the flow give up too
# (their Ray task cancelled), instead of holding the flow's exit until a long stage ends.
STOPPING = threading.Event()
# Set by the watch of the Ray this process runs on (watch_local_raylet, watch_joined_cluster) when it dies.
RAY_LOST = threading.Event()
# ... and that was a cluster this process joined, whose GCS is gone too: nothing there answers a call any more
CLUSTER_LOST = threading.Event()


class RayUnreachable(ConnectionError):
    """The Ray cluster at ``ray.address`` could not be joined: one line naming it."""


class RayFailedToStart(RuntimeError):
    """The local Ray this command starts kept dying during its own start (RAY_START_TRIES times): one line."""


RAY_START_TRIES = 3  # starts of a command's local Ray that died during its start, before RayFailedToStart


class LocalRayDied(RuntimeError):
    """The Ray this process runs on is gone (seen by ``watch_local_raylet`` or ``watch_joined_cluster``)."""


def watch_local_raylet(poll_s: float = 0.5) -> None:
    """Notice within a second that the raylet of the local Ray this process started died (Ray's driver learns
    it from the node's health checks, ~40 s here): RAY_LOST and STOPPING are set, and ``wait_result`` raises
    LocalRayDied in the flow's main thread. On a cluster this process joined, ``watch_joined_cluster``."""
    node = getattr(ray._private.worker, "_global_node", None)
    infos = (getattr(node, "all_processes", None) or {}).get("raylet") or []
    raylet = getattr(infos[0], "process", None) if infos else None
    if raylet is None:
        return
    _watch(node, lambda: not _exited(raylet), poll_s)


def watch_joined_cluster(poll_s: float = 1.0, lost_after_s: float = 5.0) -> None:
    """Notice within seconds that a cluster this process joined (``ray.address``) is gone: its GCS or this node's
    raylet no longer accepts connections for ``lost_after_s``. Ray's driver would wait 60 s for the GCS, then
    end the process without a word."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    gcs_host, _, gcs_port = node.gcs_address.rpartition(":")
    endpoints = [(gcs_host, int(gcs_port)), (node.node_ip_address, node.node_manager_port)]
    down_since: list[float] = []

    def answers() -> bool:
        try:
            for endpoint in endpoints:
                socket.create_connection(endpoint, timeout=poll_s).close()
        except OSError:
            down_since[:] = down_since or [time.monotonic()]
            return time.monotonic() - down_since[0] < lost_after_s
        down_since.clear()
        return True

    _watch(node, answers, poll_s, CLUSTER_LOST)


def _watch(node, alive: Callable[[], bool], poll_s: float, *also: threading.Event) -> None:
    """A daemon thread that sets RAY_LOST (STOPPING, ``also``) once ``alive()`` fails while ``node`` is this process's."""
    for event in (RAY_LOST, *also):
        event.clear()

    def ours() -> bool:  # ray.shutdown disconnects before it stops the raylet; a later ray.init is another node
        return ray.is_initialized() and getattr(ray._private.worker, "_global_node", None) is node

    def watch() -> None:
        while ours() and alive():
            time.sleep(poll_s)
        if ours():
            for event in also:
                event.set()
            RAY_LOST.set()
            STOPPING.set()  # stage threads stop waiting on the dead node too

    threading.Thread(target=watch, name="rlstage-ray-watch", daemon=True).start()


def mute_node_death_reports() -> None:
    """Ray's driver prints what the GCS reports of a dead node (the raylet's state dump, dozens of lines); the
    command says it in one line instead. ``--verbose`` does not call this."""
    import ray._private.worker as worker

    shown = worker.print_to_stdstream
    if getattr(shown, "mutes_node_deaths", False):
        return

    def print_unless_node_death(data, *args, **kwargs):
        text = " ".join(data.get("lines", ()))
        if data.get("pid") == "raylet" and ("Raylet is terminated" in text or "has been marked dead" in text):
            return
        shown(data, *args, **kwargs)

    print_unless_node_death.mutes_node_deaths = True
    worker.print_to_stdstream = print_unless_node_death


def cluster_address(cfg: RunConfig) -> str:
    """The Ray cluster a run joins: ``ray.address``, else the Ray head of the local stack running on this home
    (``infra/stack.sh up``, whose token it then presents), else "" (the command starts a local Ray of its own)."""
    if cfg.ray.address:
        return cfg.ray.address
    from rlstage.infra.home import running_ray

    if (stack := running_ray()) is None:
        return ""
    address, token = stack
    if os.environ.get("RAY_AUTH_TOKEN") != token and not ray.is_initialized():
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        # Ray read its settings and token when it was imported: read again, or the join is refused as unauthenticated
        ray._raylet.Config.initialize("")
        ray._raylet.AuthenticationTokenLoader.instance().reset_cache()
    return address


def ensure_ray(cfg: RunConfig) -> None:
    """Join the run's cluster (``cluster_address``) or start a local single-node Ray on 127.0.0.1.

    Must run after ``PREFECT_API_URL`` is set: Ray workers inherit the environment, and without
    it each worker would start its own temporary Prefect server.
    """
    if ray.is_initialized():
        return
    apply_defaults()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if address := cluster_address(cfg):
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
        except ConnectionError as err:
            # Ray 2.60 joins an explicit address without the token that `ray start` now requires by default
            hint = "" if os.environ.get("RAY_AUTH_MODE") else (
                "; a cluster with token authentication (the default of `ray start`) is joined with RAY_AUTH_MODE=token"
                " and its token (~/.ray/auth_token or RAY_AUTH_TOKEN)"
            )  # fmt: skip
            raise RayUnreachable(f"cannot join the Ray cluster at {address}: {err}{hint}") from None
        watch_joined_cluster()
    else:
        _start_local_ray(cfg)
    # Ray's core worker replaces the process's SIGTERM handler with one that aborts; the command's
    # own handlers stop what it started (flows/cli.py), so they are put back.
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _start_local_ray(cfg: RunConfig) -> None:
    """A local single-node Ray on 127.0.0.1. One whose processes die during its start (``ray.init`` then raises
    after ~30 s, "timed out during startup", or returns with a process already gone) is stopped and started
    again, RAY_START_TRIES times in all, each said in one line; then RayFailedToStart. Drill point
    ``ray:start`` (``drill.hold_worker_at``): held once ``ray.init`` returned, before its processes are checked."""
    for attempt in range(1, RAY_START_TRIES + 1):
        before = _ray_children()
        try:
            ray.init(
                # "local": a new cluster even where /tmp/ray names another (a `ray start` or a dead one)
                address="local",
                num_cpus=cfg.ray.num_cpus,
                include_dashboard=False,
                object_store_memory=cfg.ray.object_store_memory_mb << 20,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.ERROR,  # its start-up lines are noise in the command's output
                # Ray kills idle task workers past a soft limit of num_cpus, and the role actors count against it:
                # with the rollout role placed apart, the second stage task in flight then started a fresh worker
                # process every iteration (measured 6.9 s of imports in each pipelined iteration's reward stage).
                _system_config={"num_workers_soft_limit": WORKERS_SOFT_LIMIT},
            )
            hold_point(cfg, "ray:start")
            dead = _dead_ray_processes()
            if not dead:
                watch_local_raylet()
                return
            why = f"its {', '.join(dead)} exited"
        except (ValueError, TypeError):  # Ray's own check of its arguments: not a death
            raise
        except Exception as err:
            why = " ".join(str(err).split()) or type(err).__name__
        _stop_failed_start(before)
        if attempt == RAY_START_TRIES:
            raise RayFailedToStart(f"the local Ray this command starts died during its start, {attempt} times ({why})")
        print(
            f"rlstage: the local Ray this command starts died during its start ({why}); starting it again "
            f"(try {attempt + 1} of {RAY_START_TRIES})",
            file=sys.stderr,
            flush=True,
        )


def _dead_ray_processes() -> list[str]:
    """The processes of this process's local Ray node that have exited (gcs_server, raylet, ...)."""
    node = getattr(ray._private.worker, "_global_node", None)
    dead = []
    for name, infos in (getattr(node, "all_processes", None) or {}).items():
        if any(getattr(info, "process", None) is not None and _exited(info.process) for info in infos):
            dead.append(name)
    return sorted(dead)


def _exited(process) -> bool:
    """Whether a Ray process (a Popen) has exited. ``poll()`` alone answers None while another thread waits on
    it (Popen's waitpid lock), so the process's own /proc entry decides too: gone, or a zombie not yet reaped."""
    return process.poll() is not None or not pid_running(process.pid)


def _ray_children() -> set[int]:
    """This process's children that run Ray's binaries or modules (a node's gcs_server, raylet, reaper, ...)."""
    ray_dir, me, found = os.path.dirname(ray.__file__).encode(), str(os.getpid()).encode(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = f.read().rsplit(b")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == me and (ray_dir in cmdline or b"ray._private" in cmdline):
            found.add(int(pid))
    return found


def _stop_failed_start(before: set[int]) -> None:
    """What a local Ray start that failed left: its node (ray.shutdown), and the processes of a node ``ray.init``
    never returned (children running Ray that were not there before the start), so the next start is alone."""
    ray.shutdown()
    for pid in _ray_children() - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_result(future, poll_s: float = 0.05, meanwhile: Callable[[], None] | None = None):
    """A stage task's result (a Prefect future of a task run in a thread of the flow), waited for in short
    steps in the flow's main thread, where a signal's exception surfaces; it also sets ``STOPPING``, so the
    stage threads stop waiting on Ray as well. ``meanwhile`` runs once the task has been under way for a
    step (its stage then computes in a worker) and has not ended."""
    try:
        while not future.wrapped_future.done():
            concurrent.futures.wait([future.wrapped_future], timeout=poll_s)
            if RAY_LOST.is_set():
                raise LocalRayDied("the Ray this command runs on stopped answering")
            if meanwhile is not None and not future.wrapped_future.done():
                meanwhile()
                meanwhile = None
    except BaseException as err:
        if not isinstance(err, Exception):  # a signal
            STOPPING.set()
        raise
    return future.result()


def get_unless_stopping(ref: ray.ObjectRef, poll_s: float = 0.2):
    """``ray.get`` of ``ref`` from a thread of the flow; once the flow is stopping (``STOPPING``), the Ray task
    is cancelled (its worker killed: a stage commits its manifest last, so nothing half-written shows) and the
    wait ends with KeyboardInterrupt, which Prefect records as a crash, not a failure to retry."""
    while not ray.wait([ref], timeout=poll_s)[0]:
        if STOPPING.is_set():
            ray.cancel(ref, force=True)
            raise KeyboardInterrupt("the flow was stopped")
    return ray.get(ref)
