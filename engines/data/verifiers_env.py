"""verifiers tasksets (PyPI ``verifiers``) behind a process boundary: ``data.source: verifiers``.

verifiers cannot share rlstage's environment (its pins conflict with vLLM's and OpenEnv's), so it runs in one of its
own: ``verifiers_sidecar.py`` under that environment's interpreter lists a taskset's tasks at data prep and plays
episodes in the rollout and eval stages, each with the taskset's harness talking to rlstage's agent endpoint
(``rlstage.engines.agents.verifiers_env:episode``). One serving sidecar per process and taskset, started on first
use, ended when the process ends (it stops when its stdin closes).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SOURCE = "verifiers"
PYTHON_ENV = "RLSTAGE_VERIFIERS_PYTHON"  # the interpreter when data.source_settings.python is empty
SIDECAR = Path(__file__).with_name("verifiers_sidecar.py")


class VerifiersError(RuntimeError):
    """The verifiers environment cannot be used: one line naming the interpreter, the taskset and what failed."""


class VerifiersSettings(BaseModel):
    """``data.source_settings`` of ``data.source: verifiers``: a verifiers taskset's tasks as prompts, its reward
    as the samples' reward. The taskset runs in its own Python environment (``scripts/verifiers-env.sh`` makes one)
    with verifiers' tool-less chat harness (``null``), played by the agent
    ``rlstage.engines.agents.verifiers_env:episode``."""

    model_config = ConfigDict(extra="forbid")
    taskset: str = Field(description="the taskset's id, as verifiers loads it (an installed taskset package)")
    taskset_args: dict[str, Any] = Field(
        default_factory=dict, description="the taskset's config fields (its TasksetConfig)"
    )
    python: str = Field(
        "",
        description=f"the interpreter of the environment with verifiers and the taskset; empty: ${PYTHON_ENV}",
    )
    train_size: int = Field(1000, ge=1, description="training tasks: the ones after the held-out ones")
    test_size: int = Field(
        100, ge=1, description="held-out tasks, never trained on: the taskset's first ones"
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="seconds the environment may take to list tasks or start serving"
    )

    def interpreter(self) -> str:
        python = self.python or os.environ.get(PYTHON_ENV, "")
        if not python:
            raise VerifiersError(
                f"data source verifiers needs an interpreter: set data.source_settings.python or {PYTHON_ENV}"
            )
        if not os.access(python, os.X_OK):
            raise VerifiersError(
                f"data source verifiers: {python} is not an executable interpreter (data.source_settings.python / {PYTHON_ENV})"
            )
        return python

    def spec(self) -> dict[str, Any]:
        return {"taskset": self.taskset, "taskset_args": self.taskset_args}


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def list_tasks(s: VerifiersSettings, count: int) -> list[dict[str, Any]]:
    """The taskset's first ``count`` tasks: ``key``, ``prompt`` (text or messages), ``system_prompt``, ``data``."""
    lines = _task_lines(
        s.interpreter(), json.dumps({**s.spec(), "count": count}, sort_keys=True), s.startup_timeout_s
    )
    return [json.loads(line) for line in lines]


@functools.lru_cache(maxsize=4)  # data prep asks for both splits (a process lists a taskset once): importing verifiers takes seconds
def _task_lines(python: str, spec: str, timeout_s: float) -> tuple[str, ...]:
    where = f"verifiers taskset {json.loads(spec)['taskset']!r} ({python})"
    try:
        done = subprocess.run(
            [python, "-P", str(SIDECAR), "tasks", spec],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise VerifiersError(f"{where}: listing tasks took over {timeout_s:g} s") from None
    if done.returncode != 0:
        raise VerifiersError(f"{where}: {_tail(done.stderr)}")
    return tuple(line for line in done.stdout.splitlines() if line.strip())


class Sidecar:
    """A serving sidecar: ``episode`` sends one episode's request and awaits its reward (or its error)."""

    def __init__(self, s: VerifiersSettings) -> None:
        self.settings = s
        python = s.interpreter()
        self.proc = subprocess.Popen(
            [python, "-P", str(SIDECAR), "serve", json.dumps(s.spec())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.numbers = itertools.count()
        self.lock = threading.Lock()
        ready = concurrent.futures.Future()
        self.reader = threading.Thread(
            target=self._read, args=(ready,), name="rlstage-verifiers-sidecar", daemon=True
        )
        self.reader.start()
        try:
            ready.result(timeout=s.startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise VerifiersError(
                f"verifiers taskset {s.taskset!r} ({python}): not serving after {s.startup_timeout_s:g} s"
            ) from None

    def _read(self, ready: concurrent.futures.Future) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict):
                continue  # not the protocol's: the sidecar sends only JSON objects
            if message.get("ready"):
                ready.set_result(True)
                continue
            future = self.pending.pop(message.get("n"), None)
            if future is not None and not future.done():
                future.set_result((message.get("reward"), message.get("error")))
        code = self.proc.wait()
        gone = VerifiersError(
            f"verifiers taskset {self.settings.taskset!r}: its sidecar exited (code {code}; its log is the stage's stderr)"
        )
        if not ready.done():
            ready.set_exception(gone)
        with self.lock:
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(gone)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    async def episode(self, data: dict, base_url: str, headers: dict[str, str], model: str) -> float:
        """One episode of the task ``data`` against the endpoint at ``base_url``: the taskset's reward."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            n = next(self.numbers)
            self.pending[n] = future
            try:
                self.proc.stdin.write(
                    json.dumps(
                        {"n": n, "data": data, "base_url": base_url, "headers": headers, "model": model}
                    )
                    + "\n"
                )
                self.proc.stdin.flush()
            except OSError:
                self.pending.pop(n, None)
                raise VerifiersError(
                    f"verifiers taskset {self.settings.taskset!r}: its sidecar has exited"
                ) from None
        reward, error = await asyncio.wrap_future(future)
        if error is not None:
            raise VerifiersError(error)
        return float(reward)

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the sidecar ends with its stdin
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_SIDECARS: dict[str, Sidecar] = {}
_SIDECARS_LOCK = threading.Lock()


def sidecar_for(s: VerifiersSettings) -> Sidecar:
    """This process's serving sidecar for the settings' taskset, started (again, if it exited) on first use."""
    key = json.dumps([s.interpreter(), s.spec()], sort_keys=True)
    with _SIDECARS_LOCK:
        sidecar = _SIDECARS.get(key)
        if sidecar is None or not sidecar.alive:
            sidecar = _SIDECARS[key] = Sidecar(s)
        return sidecar


@atexit.register
def _close_sidecars() -> None:
    for sidecar in _SIDECARS.values():
        sidecar.close()
