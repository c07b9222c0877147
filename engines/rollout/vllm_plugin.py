"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM loads it in each of its
processes, the engine core and the model worker included, which rlstage's code does not otherwise reach (inside
a Ray actor vLLM spawns them).

What it changes, only in the processes of an engine started with ``rollout.vllm.quiet_waits`` (``QUIET_WAITS``
in their environment): a process waiting on vLLM's shared-memory queue sleeps on the writer's notification
instead of spinning for a second after each message. On a CPU the engine core's spin took ~0.7 of a core for
the whole rollout, from the worker's OpenMP threads; measured on SmolLM2-135M with both cores bound, 32 samples
of up to 256 tokens: 59 s spinning, 35 s sleeping. A tiny model's millisecond steps pay a wake-up each instead
(README: engines), so it is a setting.
"""

from __future__ import annotations

import os

QUIET_WAITS = "RLSTAGE_VLLM_QUIET_WAITS"


def register() -> None:
    """Make shared-memory queue readers sleep between messages (idempotent; vLLM may call it more than once)."""
    if os.environ.get(QUIET_WAITS) != "1":
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM layout: its waits stay as they are
        return
    if getattr(SpinCondition, "rlstage_quiet", False):
        return
    spin_wait = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        # Read at each wait: a process forked from a patched one may belong to an engine that did not ask.
        if os.environ.get(QUIET_WAITS) == "1":
            self.busy_loop_s = 0  # straight to the poll: the writer notifies after every message
        return spin_wait(self, timeout_ms)

    SpinCondition.wait = wait
    SpinCondition.rlstage_quiet = True
