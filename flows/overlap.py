"""What a training run overlaps with its stages' compute, and what each buys (docs/benchmarks.md, "The next
iteration opens while this one evaluates"; demo config on this 2-core machine, iterations of ~5 s):

- ``IterationThread``: each iteration's Prefect subflow runs in a thread of the training flow, and iteration k+1's
  opens as soon as k has trained, while k evaluates. Opening a subflow is nine Prefect API requests (~0.1-0.15 s);
  they overlap k's eval instead of adding to every iteration: 5.9 % -> 3.1 % of the iteration's wall outside
  the stages. The stages of k+1 still start only once k's have ended, so the schedule of stages is the
  synchronous one.
- ``Meanwhile``: an ended iteration's Prefect artifacts are written by the flow's thread while a stage of the next
  one computes in its Ray worker, never beside another of the flow's API writes (the local server's SQLite
  answers "busy" and Prefect's client retries after 2 s): 6.9 % -> 5.9 %.

The MLflow records go to a background thread of their own (infra/bookkeeping.py: ``Bookkeeper``, 8.7 % -> 6.8 %).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from rlstage.infra.ray_runtime import STOPPING


class PreviousIterationFailed(RuntimeError):
    """An iteration opened during its predecessor's eval ends without running a stage when that eval failed."""


def wait_event(event: threading.Event) -> None:
    """Wait in short steps: a signal then surfaces in the flow's main thread (an unbounded wait would hold it)."""
    while not event.wait(0.05):
        pass


class Meanwhile:
    """Jobs for the flow's own thread to run while a stage computes in a Ray worker. Each job runs once, in the
    context it was deferred from (its artifacts belong to that flow run); a failure is kept and raised by
    ``raise_failure``, in the flow's loop, not inside the stage it overlapped."""

    def __init__(self) -> None:
        self._jobs: list[tuple[contextvars.Context, Callable[[], None]]] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()  # two iterations' subflows may both be waiting on stages

    def defer(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.append((contextvars.copy_context(), job))

    def run(self) -> None:
        """Run the deferred jobs, in order; the first failure is kept, the later jobs still run."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for ctx, job in jobs:
            try:
                ctx.run(job)
            except Exception as err:
                self._failure = self._failure or err

    def raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure


# The iteration a subflow runs in: its subflow finds it here (a flow's parameters are serialized, a thread is not).
_CURRENT: ContextVar[IterationThread | None] = ContextVar("rlstage_iteration_thread", default=None)


class IterationThread:
    """One iteration's subflow, in a thread of the training flow (see the module's docstring)."""

    def __init__(self, iteration: int, call: Callable[[], Any], previous: IterationThread | None, meanwhile: Meanwhile) -> None:
        self.iteration = iteration
        self.previous = previous
        self.meanwhile = meanwhile  # run by each stage's wait (flows/training.py: StageTasks)
        self.outcome: Any = None
        self.error: BaseException | None = None
        self.trained: Any = None  # what the iteration holds once trained (None: it did not train)
        self.update_future: Any = None  # the task that made the policy the next iteration starts from
        self.stages_end: float | None = None  # perf_counter when the last stage ended
        self.has_trained = threading.Event()
        self.has_stages_ended = threading.Event()
        self.done = threading.Event()
        ctx = contextvars.copy_context()  # the training flow's run context: the subflow is its child
        ctx.run(_CURRENT.set, self)
        self._thread = threading.Thread(target=ctx.run, args=(self._run, call), name="rlstage-iteration", daemon=True)
        self._thread.start()

    @staticmethod
    def current() -> IterationThread | None:
        return _CURRENT.get()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.outcome = call()
        except BaseException as err:  # raised by the training loop, in the flow's main thread
            self.error = err
        finally:
            if self.stages_end is None:
                self.stages_end = time.perf_counter()
            self.has_stages_ended.set()
            self.has_trained.set()
            self.done.set()

    # Called in the subflow's thread.
    def after_previous_stages(self) -> None:
        """Wait until the previous iteration's stages have ended; fail (running nothing) when it failed."""
        previous = self.previous
        if previous is None:
            return
        while not previous.has_stages_ended.wait(0.05):
            if STOPPING.is_set():
                raise KeyboardInterrupt("the flow was stopped")
        if previous.error is not None:
            raise PreviousIterationFailed(f"iteration {previous.iteration} failed: {previous.error}")

    def mark_trained(self, held: Any, update_future: Any) -> None:
        """The iteration has trained (its eval may still run): the loop may open the next one."""
        if not self.has_trained.is_set():
            self.trained, self.update_future = held, update_future
            self.has_trained.set()

    def stages_ended(self) -> None:
        self.stages_end = time.perf_counter()
        self.has_stages_ended.set()

    def result(self) -> Any:
        wait_event(self.done)
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome
