"""The run's config model (``RunConfig``) with its trainer, Ray, tracking and drill sections."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlstage.schemas.config.base import _RUN_NAME, HASHED_WHEN_SET, _Section, drop_unset_late_settings
from rlstage.schemas.config.inputs import (
    CALCULATOR_PATHS,
    AgentConfig,
    DataConfig,
    KitConfig,
    ModelConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    SFTConfig,
    StoreConfig,
)
from rlstage.schemas.config.migrations import flat_form, hashed_paths, legacy_callables, plain_entry_names
from rlstage.schemas.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    RolloutCorrectionConfig,
)


class TrainerConfig(_Section):
    iterations: int = Field(10, ge=0)  # iterations of the run (a nightly continuation adds more)
    eval_every: int = Field(1, ge=1)  # iterations between held-out evaluations (the start policy and the last are always evaluated)
    eval_n: int = Field(0, ge=0)  # sampled answers per held-out prompt for mean@N (0: greedy only)
    # maj@N is reported where the reward function extracts answers (verl: where it returns a pred); true
    # refuses, at config load, a reward function that extracts none instead of leaving maj@N out
    eval_require_maj: bool = False
    seed: int = 0  # the run's seed: each iteration's update shuffle and fresh heads derive from it (sft.seed is SFT's)
    # Policy weights + optimizer state are stored every k-th update; a policy in between is rebuilt
    # on demand (resume, replay, a restarted worker) by re-running its updates from stored experience.
    checkpoint_every: int = Field(1, ge=1)
    # Retention (verl's max_actor_ckpt_to_keep): after each iteration only the newest k policy checkpoints keep
    # their weights and optimizer state, plus every m-th iteration's (keep_checkpoint_every); a pruned policy is
    # rebuilt on demand from the nearest kept one, as between checkpoints. None keeps every checkpoint.
    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    keep_checkpoint_every: int | None = Field(None, ge=1)  # also keep every m-th iteration's checkpoint (with max_actor_ckpt_to_keep)
    # Pipelined iterations: the rollout of iteration k+1 runs while update k trains, with the policy that
    # iteration k started from, so a rollout lags the trained policy by this many versions (0: synchronous).
    # Needs ray.rollout_placement=separate; pair it with algorithm.rollout_correction (off-policy weights).
    async_staleness: int = Field(0, ge=0, le=1)


class StageResources(_Section):
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0, ge=0)
    retries: int = Field(2, ge=0)
    retry_delay_s: float = Field(1.0, ge=0)


class RayConfig(_Section):
    address: str | None = None  # None starts a local Ray; "auto" or ray://host:port joins one
    num_cpus: int | None = Field(None, ge=1)  # CPUs of a local Ray (None: the machine's)
    object_store_memory_mb: int = Field(128, ge=75)  # a local Ray's object store (75 MiB at least)
    worker_num_cpus: float = Field(1, ge=0)  # each long-lived engine actor (rank)
    worker_num_gpus: float = Field(0, ge=0)  # GPUs per trainer rank
    # Data-parallel trainer ranks (DeepSpeed over gloo on CPU, NCCL on GPU). Rank 0 also holds the rollout
    # engine, the reference and the critic; N > 1 trains with actor.engine=torch (an all-reduce per step) or
    # deepspeed (ZeRO 0-3; under ZeRO 1-3 each rank checkpoints its own optimizer partition).
    trainer_world_size: int = Field(1, ge=1)
    # The rollout role: on trainer rank 0 (colocated, sharing its weights) or an actor of its own that gets
    # new weights by a same-node file handoff or from the store, so generation can run while the trainer trains.
    rollout_placement: Literal["colocated", "separate"] = "colocated"
    rollout_num_cpus: float = Field(1, ge=0)  # each rollout actor's
    rollout_num_gpus: float = Field(0, ge=0)  # GPUs per rollout actor
    # Rollout actors placed apart, each with its own engine and copy of the weights; a generation's prompts are
    # split between them (data-parallel generation, as verl's rollout replicas).
    rollout_num_workers: int = Field(1, ge=1)
    # The reference and critic roles: on trainer rank 0 (colocated) or an actor of their own (separate), which
    # loads them from the store, serves their log-probs and values, and trains and commits the critic.
    ref_critic_placement: Literal["colocated", "separate"] = "colocated"
    ref_critic_num_cpus: float = Field(1, ge=0)  # CPUs of the separate reference/critic actor
    ref_critic_num_gpus: float = Field(0, ge=0)  # its GPUs
    # Custom Ray resources each role's actors require, e.g. {"node_a": 1}: puts roles on chosen nodes.
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    rollout_resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources the rollout actors require
    ref_critic_resources: dict[str, float] = Field(default_factory=dict)  # those the reference/critic actor requires
    stages: dict[str, StageResources] = Field(default_factory=dict)  # per stage (rollout, reward, ...): CPUs, GPUs, retries and retry delay of its Ray task
    # Seconds a released role worker stays idle for the next run of the same model and engines on its Ray cluster
    # (a library user's loop in one process; later commands on a stack's or ray.address cluster), which then skips
    # the worker's start; 0 stops workers with their run.
    warm_worker_idle_s: float = Field(300.0, ge=0, json_schema_extra=HASHED_WHEN_SET)

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, v: dict[str, StageResources]) -> dict[str, StageResources]:
        from rlstage.schemas.stages import STAGES

        for name in v:
            if name not in STAGES:
                raise ValueError(f"unknown stage {name!r}; valid: {', '.join(STAGES)}")
        return v

    def resources(self, stage: str) -> StageResources:
        return self.stages.get(stage, StageResources())


class TrackingConfig(_Section):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else <RLSTAGE_HOME>/mlflow/mlflow.db
    experiment: str = "rlstage"  # the MLflow experiment runs are logged to
    rollout_sample_rows: int = Field(16, ge=0)  # sampled responses per iteration logged to MLflow as a table (0: none)


class DrillConfig(_Section):
    """Failure drills for tests: SIGKILL the process at ``<stage>:<iteration>`` points, once each."""

    kill_at: list[str] = Field(default_factory=list)  # stage tasks, after computing, before committing
    kill_flow_after: list[str] = Field(default_factory=list)  # the flow process, after a stage returns
    # whichever process commits the stage's artifact, after its data files and before its manifest
    kill_in_commit: list[str] = Field(default_factory=list)
    # role worker processes: inside the call that trains ("update:<k>" rank 0, "update@rank1:<k>", ...), or
    # inside a role's call of a stage ("<stage>@<role>:<k>", role rollout | actor | ref | critic)
    kill_worker_at: list[str] = Field(default_factory=list)
    # role worker processes, at the same points, the eval stage ("eval:<k>") and the command's start ("ray:start"
    # once its local Ray is up, "prefect_server:start" while its Prefect server boots): write ``held-<point>`` in
    # ``markers`` and wait there until ``release-<point>`` appears (up to 300 s), so a test can keep one role
    # busy while another works, or kill a service at a known point
    hold_worker_at: list[str] = Field(default_factory=list)
    markers: str | None = None  # folder of fired-once markers


class RunConfig(_Section):
    run_name: str = "demo"  # the run's name: its folder in the store, its MLflow run, its Prefect flow runs' names
    kit: KitConfig = Field(default_factory=KitConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    drill: DrillConfig = Field(default_factory=DrillConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    # Modules imported before the config's names are looked up, to register third-party entries (as the
    # ``rlstage.plugins`` entry points are): code to import, so a stored config may not name them (code_settings).
    plugins: list[str] = Field(default_factory=list, json_schema_extra=HASHED_WHEN_SET)

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str) -> str:
        if not _RUN_NAME.match(v) or ".." in v:
            raise ValueError(f"run name {v!r} must be letters, digits, '_', '-', '.' (no '/', no '..')")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        # What the estimator and the loss need (critic, groups, ...) is checked with the registries: engines/preflight.py
        fg = self.algorithm.filter_groups
        if fg.enable and fg.max_num_gen_batches == 0:
            raise ValueError(
                "algorithm.filter_groups.max_num_gen_batches=0: dynamic sampling needs a cap on generation rounds "
                "(verl reads 0 as no cap); give one >= 1, e.g. 10"
            )
        if fg.enable and self.rollout.n < 2:
            raise ValueError(
                f"rollout.n={self.rollout.n}: algorithm.filter_groups.enable drops groups whose samples all score "
                "alike, which a group of one always does; use rollout.n >= 2"
            )
        if fg.enable and fg.metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            raise ValueError(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: the KL penalty is "
                "applied after the filter (advantage stage); filter on seq_reward"
            )
        gen = self.data.gen_batch_size
        if gen is not None and gen != self.data.prompts_per_iteration and not fg.enable:
            raise ValueError(
                f"data.gen_batch_size={gen} differs from data.prompts_per_iteration={self.data.prompts_per_iteration} "
                "without algorithm.filter_groups.enable: every generated prompt is trained on, so set "
                "data.prompts_per_iteration instead"
            )
        rc = self.algorithm.rollout_correction
        if self.actor.rollout_correction not in (RolloutCorrectionConfig(), rc):
            raise ValueError("actor.rollout_correction is copied from algorithm.rollout_correction: set it there")
        if self.actor.policy_loss.name == "bypass_mode" and not rc.bypass_mode:
            raise ValueError(
                "actor.policy_loss=bypass_mode is selected by algorithm.rollout_correction.bypass_mode=true"
            )
        if rc.bypass_mode and self.actor.policy_loss.name not in ("vanilla", "bypass_mode"):
            raise ValueError(
                f"algorithm.rollout_correction.bypass_mode=true replaces actor.policy_loss={self.actor.policy_loss.name} "
                "(its loss is rollout_correction.loss_type): leave actor.policy_loss at vanilla"
            )
        if self.actor.rollout_correction != rc:
            self.actor.rollout_correction = rc.model_copy()
        if self.actor.ppo_mini_batch_size % self.actor.micro_batch_size:
            raise ValueError("actor.ppo_mini_batch_size must be a multiple of actor.micro_batch_size")
        if self.trainer.async_staleness and self.ray.rollout_placement != "separate":
            raise ValueError(
                f"trainer.async_staleness={self.trainer.async_staleness} overlaps rollout with training, which needs "
                "ray.rollout_placement=separate (colocated roles share one actor and cannot overlap)"
            )
        if self.trainer.async_staleness and self.algorithm.rollout_correction.bypass_mode:
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode takes the rollout's log-probs as the trained policy's, but "
                f"with trainer.async_staleness={self.trainer.async_staleness} the rollout samples with older weights"
            )
        workers = self.ray.rollout_num_workers
        if workers > 1 and self.ray.rollout_placement != "separate":
            raise ValueError(
                f"ray.rollout_num_workers={workers} places rollout actors apart from the trainer: set "
                "ray.rollout_placement=separate"
            )
        if workers > 1 and self.agent.enable:
            raise ValueError(
                f"ray.rollout_num_workers={workers}: agent.enable's multi-turn loop runs on one rollout actor; set "
                "ray.rollout_num_workers=1"
            )
        # Whether ray.ref_critic_placement=separate has a reference or critic to place, whether rollout.share_prompts
        # and model.lora_rank suit the rollout engine: what the registries declare (engines/preflight.py: check_placement,
        # check_rollout_engine).
        world = self.ray.trainer_world_size
        if world > 1:
            samples = self.data.prompts_per_iteration * self.rollout.n
            if self.actor.ppo_mini_batch_size % world or samples % self.actor.ppo_mini_batch_size:
                raise ValueError(
                    f"ray.trainer_world_size={world} must divide actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size}, "
                    f"which must divide the {samples} samples of an iteration (data.prompts_per_iteration x rollout.n)"
                )
        if self.trainer.keep_checkpoint_every is not None and self.trainer.max_actor_ckpt_to_keep is None:
            raise ValueError(
                f"trainer.keep_checkpoint_every={self.trainer.keep_checkpoint_every} keeps extra checkpoints of a pruned "
                "run, but nothing is pruned without trainer.max_actor_ckpt_to_keep (e.g. 2)"
            )
        if self.model.lora and self.actor.engine == "deepspeed" and self.actor.zero_stage == 3:
            raise ValueError(
                f"model.lora_rank={self.model.lora_rank} with actor.zero_stage=3: ZeRO-3 would shard the frozen base "
                "that the reference and the rollout share; use zero_stage 0-2 (the adapters' optimizer state is small)"
            )
        if self.critic.ppo_mini_batch_size % self.critic.micro_batch_size:
            raise ValueError("critic.ppo_mini_batch_size must be a multiple of critic.micro_batch_size")
        if self.actor.group_mini_batches and self.actor.ppo_mini_batch_size % self.rollout.n:
            raise ValueError(
                f"actor.group_mini_batches: actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} must be a multiple of "
                f"rollout.n={self.rollout.n}, so that a mini-batch holds whole groups"
            )
        # A remainder would be a short last mini-batch each epoch, a step on fewer samples than configured.
        samples = self.data.prompts_per_iteration * self.rollout.n
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            if samples % section.ppo_mini_batch_size and (name == "actor" or self.critic.enable):
                raise ValueError(
                    f"{name}.ppo_mini_batch_size={section.ppo_mini_batch_size} does not divide the samples per "
                    f"iteration, data.prompts_per_iteration x rollout.n = {samples}"
                )
        # A token budget must hold the longest possible sequence (as verl's ppo_max_token_len_per_gpu).
        if self.agent.enable:
            response_key, response_max = "agent.max_response_tokens", self.agent.max_response_tokens
        else:
            response_key, response_max = "rollout.max_new_tokens", self.rollout.max_new_tokens
        buffer = self.reward.overlong_buffer
        if buffer.enable and not 0 < buffer.len <= response_max:
            raise ValueError(
                f"reward.overlong_buffer.len={buffer.len} must be > 0 and at most {response_key}={response_max}"
            )
        rm = self.reward_model
        if rm.enable and (rm.model.path is None) == (rm.server.url is None):
            raise ValueError("reward_model.enable needs exactly one of reward_model.model.path and reward_model.server.url")
        longest = self.data.max_prompt_length + response_max
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            budget = section.micro_batch_tokens
            if budget is not None and budget < longest and (name == "actor" or self.critic.enable):
                raise ValueError(
                    f"{name}.micro_batch_tokens={budget} is smaller than the longest sequence, "
                    f"data.max_prompt_length + {response_key} = {longest}"
                )
        return self

    @model_validator(mode="after")
    def _maj(self) -> RunConfig:
        t = self.trainer
        if not t.eval_require_maj:
            return self
        if t.eval_n < 2:
            raise ValueError(f"trainer.eval_require_maj: maj@N votes over trainer.eval_n >= 2 sampled answers, got {t.eval_n}")
        return self  # whether the reward function extracts an answer: engines/preflight.py (it owns the registries)

    @model_validator(mode="after")
    def _agent_calculator(self) -> RunConfig:
        # Whether the tools import, and the chat template, are checked by engines/preflight.py before any stage.
        if self.agent.enable and self.kit.task == "multiply" and self.model.path is None:
            if not any(t.callable in CALCULATOR_PATHS for t in self.agent.tools):
                raise ValueError(
                    "agent.tools: kit.task=multiply warm-starts on calculator demonstrations; "
                    "declare a tool with callable rlstage.engines.agents.tools:calculator"
                )
        return self

    @property
    def max_response_tokens(self) -> int:
        """The longest response a rollout can produce (policy, tool and template tokens in agent mode)."""
        return self.agent.max_response_tokens if self.agent.enable else self.rollout.max_new_tokens

    @property
    def needs_ref(self) -> bool:
        """A frozen reference policy is needed for KL in the reward or as a loss (what schemas can answer alone; a policy
        loss may need it too: rlstage.engines.algorithms.needs_reference asks its registry entry)."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    def hashed_dump(self) -> dict:
        """The config as cache keys and run identities see it: late settings at their default left out, the settings
        that had flat names under those (flat_form: the policy loss in its 0.1 form, vLLM's as rollout.vllm_<name>), an
        estimator without settings by its plain name (plain_entry_names), moved modules by their old names
        (legacy_callables)."""
        dump = drop_unset_late_settings(type(self), self.model_dump(mode="json"))
        return legacy_callables(plain_entry_names(flat_form(dump)))

    def stage_hash(self, *sections: str) -> str:
        """Hash of the named config sections (dotted paths): what a stage's output depends on. A path of a setting
        that had a flat name is hashed by that name (hashed_paths), as stored runs' keys were."""
        dump = self.hashed_dump()
        picked = {}
        for path in (p for given in sections for p in hashed_paths(given)):
            node: Any = dump
            for part in path.split("."):
                if part not in node:  # a late setting at its default
                    break
                node = node[part]
            else:
                picked[path] = node
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]
