"""One training iteration, as code: its stages in order, each called by name with its inputs by keyword.

An iteration starts from what the last one left (``Models``: the policy, the frozen reference, the critic, the
last experience) and gains an artifact with each stage (``Artifacts``). ``iterate`` is the whole order of an
iteration. The training flow runs it with stage tasks on Ray (flows/training.py: ``StageTasks``); replay and
eval run it over the committed artifacts up to the stage they run (flows/replay.py: ``stored_inputs``), so all
three give a stage the same inputs. A stage's inputs, files and settings are declared once, in schemas/stages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlstage.engines import algorithms as algos
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import ConfigError, RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef
from rlstage.tasks.runtime import policy_ref_from
from rlstage.workers.group import critic_init_ref


@dataclass
class Models:
    """What an iteration starts from: the policy, the frozen reference, the critic, the last experience."""

    policy: PolicyRef
    ref: PolicyRef | None = None
    critic: PolicyRef | None = None
    prev_experience: Manifest | None = None
    # The policy the rollout samples with: ``policy`` when synchronous; with trainer.async_staleness=1 the
    # one the previous iteration started from (its rollout ran while that iteration's update trained).
    rollout_policy: PolicyRef | None = None

    @property
    def behaviour(self) -> PolicyRef:
        return self.rollout_policy or self.policy


def models_before(cfg: RunConfig, store: ArtifactStore, iteration: int, initial: PolicyRef) -> Models:
    """The models iteration ``iteration`` (>= 1) starts from, read from the store for k > 1."""
    ref = initial if algos.needs_reference(cfg) else None
    if iteration <= 1:
        return Models(initial, ref, critic_init_ref(initial) if cfg.critic.enable else None)

    def need(stage: str, k: int) -> Manifest:
        m = store.manifest(cfg.run_name, k, stage)
        if m is None:
            raise ConfigError(f"run {cfg.run_name!r} has no committed {stage} for iteration {k}")
        return m

    lag = iteration - 1 - cfg.trainer.async_staleness  # the update whose policy the rollout samples with
    return Models(
        policy_ref_from(need("update", iteration - 1)),
        ref,
        policy_ref_from(need("critic", iteration - 1)) if cfg.critic.enable else None,
        need("advantage", iteration - 1),
        (policy_ref_from(need("update", lag)) if lag >= 1 else initial) if cfg.trainer.async_staleness else None,
    )


@dataclass
class Artifacts:
    """What an iteration holds: what it started from, then each stage's output (a manifest, or a model)."""

    prompts: Manifest  # data prep's, once per run
    policy: PolicyRef  # the policy being trained: the update's input, then its output
    behaviour: PolicyRef  # the policy the rollout samples with (an older one when pipelined)
    ref: PolicyRef | None = None
    critic: PolicyRef | None = None
    prev_experience: Manifest | None = None
    rollouts: Manifest | None = None
    rewards: Manifest | None = None
    experience: Manifest | None = None

    @classmethod
    def start(cls, prompts: Manifest, m: Models) -> Artifacts:
        return cls(prompts, m.policy, m.behaviour, m.ref, m.critic, m.prev_experience)

    def models_after(self, started: Models, pipelined: bool) -> Models:
        """What the next iteration starts from, once this one has trained."""
        return Models(self.policy, self.ref, self.critic, self.experience, started.policy if pipelined else None)


class Stages(Protocol):
    """How an iteration's stages run: a training run's stage tasks, or the stored artifacts of a replay."""

    def __call__(self, stage: str, /, **inputs: Manifest | PolicyRef | None) -> Manifest | PolicyRef:
        """Run stage ``stage`` on ``inputs`` (its spec's inputs, by name); its output manifest, or its model."""

    def ahead(self, stage: str, iteration: int, /, **inputs: Manifest | PolicyRef | None) -> None:
        """Submit a stage of a later iteration to run beside this one's (the pipelined rollout)."""

    def eval_due(self, iteration: int) -> bool: ...


def iterate(cfg: RunConfig, iteration: int, last: int, a: Artifacts, run: Stages) -> Artifacts:
    """Iteration ``iteration`` of a run of ``last``: sample, score, [filter groups], advantages, [fit the critic],
    update the policy, then evaluate when due. Iteration 0 only evaluates the starting policy."""
    if iteration > 0:
        a.rollouts = run("rollout", prompts=a.prompts, policy=a.behaviour)
        if cfg.trainer.async_staleness and iteration < last:
            # Pipelined: the next iteration's rollout samples with the policy this one started from, on the
            # rollout role, while the trainer role computes advantages and trains; that iteration finds it committed.
            run.ahead("rollout", iteration + 1, prompts=a.prompts, policy=a.policy)
        a.rewards = run("reward", rollouts=a.rollouts)
        if cfg.algorithm.filter_groups.enable:
            # DAPO's dynamic sampling: its trimmed batch stands for the rollouts and rewards from here on.
            a.rollouts = a.rewards = run("filter_groups", prompts=a.prompts, rollouts=a.rollouts, rewards=a.rewards, policy=a.behaviour)
        a.experience = run(
            "advantage", rollouts=a.rollouts, rewards=a.rewards, policy=a.policy, ref=a.ref, critic=a.critic, prev_experience=a.prev_experience
        )  # fmt: skip
        if a.critic is not None:
            a.critic = run("critic", experience=a.experience, critic=a.critic)
        a.policy = run("update", experience=a.experience, policy=a.policy)
    if run.eval_due(iteration):
        run("eval", prompts=a.prompts, policy=a.policy)
    return a
