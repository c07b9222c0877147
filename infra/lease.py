"""One run at a time: a lease document in the store, created conditionally, expiring if its holder died."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager

from rlstage.infra.env import pid_alive
from rlstage.infra.store import ArtifactStore, CommitConflict

LEASE = "lease"


class RunLocked(RuntimeError):
    """Another live flow holds the run."""


def _holder_alive(doc: dict) -> bool:
    if doc.get("expires_at", 0) < time.time():
        return False
    if doc.get("host") == socket.gethostname():  # same machine: a dead holder process frees the lease at once
        try:
            return pid_alive(int(doc["pid"]))
        except (ValueError, KeyError):
            return False
    return True


def _held_message(run: str, held: dict) -> str:
    left = max(0, round(held.get("expires_at", 0) - time.time()))
    who = held.get("label") or "a flow"
    return (
        f"run {run!r} is already running ({who}, pid {held.get('pid')} on {held.get('host')}); wait for it to end, or "
        f"stop it: its lease expires {left} s after its holder stops renewing it"
    )


def check_lease(store: ArtifactStore, run: str) -> None:
    """Refuse with RunLocked when a live holder has the run's lease: before a command starts anything for it."""
    held = store.get_json(run, LEASE)
    if held and _holder_alive(held):
        raise RunLocked(_held_message(run, held))


@contextmanager
def run_lease(
    store: ArtifactStore,
    run: str,
    ttl_s: float = 900.0,
    label: str = "",
    flow_run_id: str = "",
    on_takeover: Callable[[dict], None] | None = None,
):
    """Hold the run's lease for the duration; refuse with RunLocked if a live holder has it.

    ``on_takeover`` gets the lease document of a dead or expired holder that this call replaces (the
    training flow marks that holder's Prefect flow run as crashed)."""
    token = uuid.uuid4().hex
    doc = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "label": label, "flow_run_id": flow_run_id}
    for _ in range(2):
        try:
            store.put_json(run, LEASE, {**doc, "expires_at": time.time() + ttl_s}, exclusive=True)
            break
        except CommitConflict:
            held = store.get_json(run, LEASE) or {}
            if _holder_alive(held):
                raise RunLocked(_held_message(run, held)) from None
            store.delete_json(run, LEASE)  # expired or dead holder: take over
            if on_takeover is not None:
                on_takeover(held)
    else:
        raise RunLocked(f"run {run!r}: could not take the lease")

    def renew() -> None:
        store.put_json(run, LEASE, {**doc, "expires_at": time.time() + ttl_s})

    try:
        yield renew
    finally:
        current = store.get_json(run, LEASE) or {}
        if current.get("token") == token:
            store.delete_json(run, LEASE)
