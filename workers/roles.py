"""The roles' interfaces: what a stage may ask of a Ray actor, declared once.

``PolicyGroup`` reaches its actors only through these methods (``group.call(Trainer.log_probs, ...)``), so
a misspelt method fails where the stage names it (an AttributeError before any Ray call, and for a type
checker), not inside a Ray actor. ``tests/workers/test_roles.py`` checks that each worker class implements its
role with the same signatures. As verl declares its actor (``verl/workers/actor/base.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

if TYPE_CHECKING:
    from rlstage.engines.agents.loop import AgentCompletion
    from rlstage.engines.rollout.base import Completion, SamplingParams
    from rlstage.engines.rollout.weight_sync import Bucket, PushPlan


class Worker(Protocol):
    """Every role's actor: where it runs, which weights it holds, and the drills' arming."""

    def pid(self) -> int: ...

    def info(self) -> dict: ...

    def version(self, role: str = "policy") -> str | None: ...

    def arm(self, stage: str, iteration: int) -> None: ...

    def busy_intervals(self) -> list[tuple[float, float]]: ...

    def close(self) -> None: ...

    def reset(self) -> None: ...  # drop the run's weights, engines and scratch: a warm worker waits for another run

    def idle(self, key: str, seconds: float) -> None: ...  # parked (workers/pool.py): it stops itself after seconds

    def expire(self, key: str, turn: int) -> None: ...  # its idle time ran out: stop unless a run took it


class Generator(Worker, Protocol):
    """A role that samples completions with the policy version it holds (the rollout role, or rank 0). The
    records cross Ray as the dataclasses they are (engines/rollout/base.py, engines/agents/loop.py)."""

    def generate_ids(self, version: str, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def agent_generate(self, version: str, rows: list[dict], params: SamplingParams) -> tuple[list[AgentCompletion], dict]: ...


class Rollout(Generator, Protocol):
    """The rollout role placed apart: takes each policy version from the trainer in memory (``receive``, then
    ``receive_commit``), or loads it from the store or its path (``acquire``)."""

    def acquire(self, ref_json: dict) -> str: ...

    def receive(self, plan: PushPlan | None, bucket: Bucket) -> bool: ...

    def receive_commit(self, ref_json: dict) -> str: ...


class Trainer(Generator, Protocol):
    """A trainer rank (rank 0 also serves the colocated rollout, reference and critic), or the actor that
    serves only the reference and critic when they are placed apart."""

    def rendezvous(self) -> tuple[str, int]: ...

    def join(self, addr: str, port: int) -> None: ...

    def adopt(self, version: str) -> bool: ...

    def acquire(self, ref_json: dict, role: str = "policy", update_hash: str | None = None) -> str: ...

    def serves_weights(self, ref_json: dict) -> bool: ...

    def push_start(self, version: str, have: str | None) -> PushPlan: ...

    def push_bucket(self) -> Bucket: ...

    def log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list: ...

    def log_probs_and_sum_pi_squared(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> tuple: ...

    def ref_log_probs(self, version: str, prompt_ids: list, response_ids: list, temperature: float) -> list: ...

    def values(self, version: str, prompt_ids: list, response_ids: list) -> list: ...

    def update(self, version: str, experience_json: dict, iteration: int, checkpoint: bool = True) -> dict: ...

    def critic_update(self, version: str, experience_json: dict, iteration: int, checkpoint: bool = True) -> dict: ...

    def commit(self, role: str, commit_json: dict, tables: dict[str, pa.Table], written: dict | None = None) -> dict: ...

    def commit_shard(self, commit_json: dict) -> dict[str, dict]: ...


def method_name(method: Callable[..., Any]) -> str:
    """The actor method a role's function names (``Trainer.log_probs`` -> ``"log_probs"``)."""
    owner = method.__qualname__.split(".", 1)[0]
    if owner not in {"Worker", "Generator", "Rollout", "Trainer"}:
        raise TypeError(f"{method.__qualname__} is not a method of a role in workers/roles.py")
    return method.__name__
