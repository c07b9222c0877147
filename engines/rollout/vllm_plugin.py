"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM loads it in each of its
processes, the engine core and the model worker included, which rlstage's code does not otherwise reach (inside
a Ray actor vLLM spawns them).

What it changes, only in the processes of an engine started with ``rollout.vllm.quiet_waits`` (``QUIET_WAITS``
in their environment): a process waiting on vLLM's shared-memory queue sleeps on the writer's notification
instead of spinning for a second after each message. On a CPU the engine core's spin took ~0.7 of a core for
the whole rollout, from the worker's OpenMP threads; measured on SmolLM2-135M with both cores bound, 32 samples
of up to 256 tokens: 59 s spinning, 35 s sleeping. A tiny model's millisecond steps pay a wake-up each instead
(README: engines), so it is a setting.

And, in every process of an engine on a CPU: the rank of each sampled token among the vocabulary's log-probs (vLLM
returns it beside the token's log-prob, rlstage never reads it) is counted eagerly instead of by a function that
vLLM compiles with torch.compile (inductor) in each process, on its first generation: measured 2.4 s with the
compile cache warm and 4.5 s cold on 2 cores, paid by every rollout worker that starts an engine; the counts are
the same integers.
"""

from __future__ import annotations

import os

QUIET_WAITS = "RLSTAGE_VLLM_QUIET_WAITS"


def register() -> None:
    """On a CPU, count sampled tokens' ranks eagerly; with ``QUIET_WAITS``, make shared-memory queue readers sleep
    between messages (idempotent; vLLM may call it more than once)."""
    _eager_rank_counts()
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


# Rows of log-probs compared at a time (prompt log-probs may hold thousands): the comparison's boolean copy, which
# the compiled kernel does not make, stays under ~40 MB at a 152k vocabulary.
_RANK_ROWS = 256


def _count_at_least(x, values):
    """``vllm.v1.sample.ops.logprobs.batched_count_greater_than`` without torch.compile: per row of ``x``, how many of
    its elements are >= that row's value in ``values`` (shape (rows, 1))."""
    import torch

    if x.shape[0] <= _RANK_ROWS:
        return (x >= values).sum(-1)
    chunks = range(0, x.shape[0], _RANK_ROWS)
    return torch.cat([(x[i : i + _RANK_ROWS] >= values[i : i + _RANK_ROWS]).sum(-1) for i in chunks])


def _eager_rank_counts() -> None:
    """On a CPU platform, vLLM's sampler counts ranks with ``_count_at_least`` (its first generation in each process
    then compiles nothing); other platforms keep vLLM's compiled kernel."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample import sampler
    except ImportError:  # another vLLM layout: its ranks stay as they are
        return
    if not current_platform.is_cpu() or not hasattr(sampler, "batched_count_greater_than"):
        return
    sampler.batched_count_greater_than = _count_at_least
