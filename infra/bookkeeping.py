"""A run's bookkeeping off the iterations' critical path: MLflow metrics, models and tables
are sent by one background thread, in the order they were asked for, while the next iteration's stages run.

Nothing is lost by the delay: the run's end waits for every job, and the metrics of a process that died
before a job ran are logged from the store by the next invocation (flows/training.py), as after a tracking
server that was away (that iteration's sample table is skipped, as then).
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Bookkeeper:
    """Jobs run in order on one thread, each ``delay_s`` after it was submitted (at once when the run closes):
    a delay lets the caller's next steps start first, where the job would compete with them for the GIL."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstage-bookkeeping")
        self._jobs: list[Future] = []
        self._closing = threading.Event()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after those submitted before it. A job that failed is raised here, by the next
        submit, so a run fails at most one iteration later than it did when bookkeeping was inline."""
        self._raise_done()
        # The job runs in the caller's context (Prefect's: what it logs belongs to the caller's flow run).
        due = time.monotonic() + self.delay_s
        self._jobs.append(self._pool.submit(self._run, due, contextvars.copy_context(), job))

    def _run(self, due: float, ctx: contextvars.Context, job: Callable[[], None]) -> None:
        self._closing.wait(max(0.0, due - time.monotonic()))
        ctx.run(job)

    def _raise_done(self) -> None:
        done = [j for j in self._jobs if j.done()]
        self._jobs = [j for j in self._jobs if not j.done()]
        for j in done:
            j.result()

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every job and stop the thread. The first failure is raised, or, while another
        exception ends the run (``raise_errors`` false), reported in one line."""
        self._closing.set()
        jobs, self._jobs = self._jobs, []
        first: BaseException | None = None
        for j in jobs:
            try:
                j.result()
            except Exception as err:  # the later jobs still run: the run's other records are worth keeping
                first = first or err
        self._pool.shutdown(wait=True)
        if first is not None:
            if raise_errors:
                raise first
            print(f"rlstage: warning: run bookkeeping failed: {first}", file=sys.stderr)
