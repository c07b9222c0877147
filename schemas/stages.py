"""The stage registry: every stage declared once, and the config view its code receives.

A stage's spec names its inputs, its output files and the dotted config paths its code may read
(its own code, the engines it calls and what the policy worker reads for it). The training flow,
replay, eval, the failure drills, ``ray.stages.<name>`` validation and the cache keys are derived
from it: a stage's cache key hashes exactly its view, and a read outside the view fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import BaseModel

from rlstage.schemas.config import RunConfig
from rlstage.schemas.manifest import Manifest, PolicyRef

# Where and how a run executes, never what a stage computes: readable by every stage, never hashed.
# The plugin modules too: what their entries compute is keyed by the plugins' versions (tasks/runtime.py).
EXECUTION = ("run_name", "store", "ray", "tracking", "drill", "plugins")


# What a registered entry needs ("critic", "groups", "sum_pi_squared", "ref"), by registry kind and name: the caller
# of a view that depends on it passes the registries' answer (rlstage.engines.registry.needs_of); schemas/ is a leaf
# that never imports them, and a view asked without it fails rather than guessing.
EntryNeeds = Callable[[str, str], frozenset[str]]


@dataclass(frozen=True)
class NeedRead:
    """Paths a stage reads only when the registry entry named at ``name`` (a dotted setting holding the entry's
    name) declares ``need``: e.g. the advantage stage reads ``actor.calculate_sum_pi_squared`` for an estimator that
    needs ``sum_pi_squared``."""

    kind: str  # the registry: "advantage estimator", ...
    name: str  # where the config names the entry
    need: str
    paths: tuple[str, ...]


class UndeclaredConfigRead(RuntimeError):
    """A stage read a setting its view does not declare: its cache key would not see a change to it."""


def keyed_if(when: Callable[[ConfigView], bool]) -> Any:
    """An input that counts in the cache key only under these settings (read through the stage's view)."""
    return field(default=None, metadata={"keyed_if": when})


@dataclass(frozen=True)
class StageInputs:
    """What a stage reads, one field per input: an artifact (a ``Manifest``) or a model (a ``PolicyRef``). A field
    that defaults to None is optional. The stage's task takes these as keyword parameters, its cache key holds each
    given input's id (``key``), and replay binds them by these names."""

    def key(self, view: ConfigView) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            value, when = getattr(self, f.name), f.metadata.get("keyed_if")
            if value is not None and (when is None or when(view)):
                out[f.name] = value.artifact_id if isinstance(value, Manifest) else value.version
        return out


@dataclass(frozen=True)
class NoInputs(StageInputs):
    pass


@dataclass(frozen=True)
class RolloutInputs(StageInputs):
    prompts: Manifest
    policy: PolicyRef  # the behaviour policy: the trained one, or an older one when pipelined


@dataclass(frozen=True)
class RewardInputs(StageInputs):
    rollouts: Manifest


@dataclass(frozen=True)
class FilterGroupsInputs(StageInputs):
    prompts: Manifest
    rollouts: Manifest
    rewards: Manifest
    policy: PolicyRef  # the behaviour policy, as the rollout's


@dataclass(frozen=True)
class AdvantageInputs(StageInputs):
    rollouts: Manifest
    rewards: Manifest
    policy: PolicyRef  # the policy the update will train: its old log-probs
    ref: PolicyRef | None = None  # the frozen reference (KL)
    critic: PolicyRef | None = None  # the value model (GAE)
    # the previous iteration's experience: its manifest carries the adaptive KL controller's state
    prev_experience: Manifest | None = keyed_if(lambda v: v.algorithm.use_kl_in_reward and v.algorithm.kl_ctrl.type == "adaptive")


@dataclass(frozen=True)
class CriticInputs(StageInputs):
    experience: Manifest
    critic: PolicyRef


@dataclass(frozen=True)
class UpdateInputs(StageInputs):
    experience: Manifest
    policy: PolicyRef


@dataclass(frozen=True)
class EvalInputs(StageInputs):
    prompts: Manifest
    policy: PolicyRef


@dataclass(frozen=True)
class StageSpec:
    """A stage's contract, declared once: its name, inputs, committed files and the settings it reads."""

    name: str
    files: tuple[str, ...]  # what it commits; the first is its main Parquet file
    reads: tuple[str, ...]  # dotted config paths its code may read (a section path covers its fields)
    # More paths that only matter for some settings, decided through the view of ``reads``.
    reads_if: Callable[[ConfigView], tuple[str, ...]] | None = None
    takes: type[StageInputs] = NoInputs  # its inputs
    output_ref: bool = False  # its output is a model checkpoint, passed on as a PolicyRef (else its manifest)
    when: Callable[[ConfigView], bool] | None = None  # runs only under these settings (read through its view)
    phase: str = "train"  # prepare: once per run; train: the iteration chain; eval: on trainer.eval_every
    replayable: bool = False
    # the run its artifact is committed under, when not the run's own (the kit's SFT start, shared by runs)
    run_of: Callable[[ConfigView], str] | None = None
    # more paths read when a named registry entry declares a need (the caller of its view passes the needs)
    reads_if_needs: tuple[NeedRead, ...] = ()

    @property
    def per_iteration(self) -> bool:
        return self.phase != "prepare"

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.takes))

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.takes) if f.default is None)

    def active(self, cfg: RunConfig | ConfigView) -> bool:
        """Whether the run's settings select this stage at all."""
        if self.when is None:
            return True
        whole = whole_config(cfg)
        some = self.reads_if(ConfigView(whole, self.name, self.reads)) if self.reads_if is not None else ()
        return self.when(ConfigView(whole, self.name, self.reads + some))


# What the policy worker reads for every stage it serves: the model's dtype, threads and source.
_WORKER = ("model",)
# The rollout engine the worker builds (batching and engine settings can change sampled tokens; vLLM's quiet_waits and
# cpu_threads_bind do not, but the rollout and eval stages start the engine with them). rollout.vllm hashes by its
# settings' flat names of before 0.2 (RunConfig.stage_hash), so that stored runs keep their keys.
_ENGINE = ("rollout.engine", "rollout.batch_size", "rollout.share_prompts", "rollout.seed", "rollout.vllm")
_SAMPLING = ("rollout.top_p", "rollout.top_k", "rollout.max_new_tokens", "rollout.seed")
# The worker's optimizer schedule length (workers.group.total_update_steps), used by decaying schedules.
_TOTAL_STEPS = (
    "data.prompts_per_iteration", "rollout.n", "actor.ppo_mini_batch_size", "actor.ppo_epochs", "trainer.iterations",
)  # fmt: skip
# The no-grad passes of the train engines (log-probs, values) batch by these settings.
_ACTOR_PASS = (
    "actor.engine", "actor.zero_stage", "actor.micro_batch_size", "actor.micro_batch_tokens", "actor.packing",
    "actor.share_prompts", "actor.logits_chunk_tokens",
)  # fmt: skip
_CRITIC_PASS = ("critic.micro_batch_size", "critic.micro_batch_tokens", "critic.packing")
_CRITIC_TRAIN = (
    *_CRITIC_PASS, "critic.optim", "critic.cliprange_value", "critic.ppo_mini_batch_size", "critic.ppo_epochs",
    "critic.loss_agg_mode", "critic.shuffle",
)  # fmt: skip


# RunConfig.max_response_tokens: agent.max_response_tokens in agent mode, else rollout.max_new_tokens.
_RESPONSE_MAX = ("agent.enable", "agent.max_response_tokens", "rollout.max_new_tokens")


def _decays(optim: Any) -> bool:
    return optim.lr_schedule != "constant" and optim.total_steps is None


def _agent(v: ConfigView) -> tuple[str, ...]:
    return ("agent",) if v.agent.enable else ()


def _reward_extra(v: ConfigView) -> tuple[str, ...]:
    # DAPO's overlong shaping measures responses against the longest one a rollout can produce.
    return (_RESPONSE_MAX if v.reward.overlong_buffer.enable else ()) + (("reward_model",) if v.reward_model.enable else ())


_ROLLOUT = (
    "data.prompts_per_iteration", "data.gen_batch_size", "data.shuffle_seed", "rollout.n", "rollout.temperature", *_SAMPLING, *_ENGINE,
    "algorithm.adv_estimator", "agent.enable", *_WORKER,
)  # fmt: skip
_REWARD = ("reward", "reward_model.enable")


def _eval_extra(v: ConfigView) -> tuple[str, ...]:
    return _agent(v) + (("rollout.temperature", "trainer.eval_require_maj") if v.trainer.eval_n > 0 else ())


SPECS: tuple[StageSpec, ...] = (
    StageSpec(
        "data_prep",
        files=("train.parquet", "test.parquet"),
        # prompts over data.max_prompt_length in the policy's tokens stop it or are dropped: the tokenizer is model.path's
        reads=(
            "data.source", "data.source_settings", "data.train_path", "data.test_path", "data.max_prompt_length",
            "data.filter_overlong_prompts", "model.path",
        ),  # fmt: skip
        # a source built from the kit's settings (its registration needs "kit": the synthetic task)
        reads_if_needs=(
            NeedRead("data source", "data.source", "kit", ("kit.task", "kit.digits", "kit.train_size", "kit.test_size", "kit.seed")),
        ),
        phase="prepare",
    ),
    StageSpec(
        "sft",
        files=("model/model.safetensors",),
        reads=("kit", "sft", "model.torch_threads"),
        # The multiply kit learns tool calls: its demonstrations and accuracy check run the agent loop.
        reads_if=lambda v: ("agent", "rollout.max_new_tokens") if v.kit.task == "multiply" else (),
        phase="prepare",
        run_of=lambda v: kit_run_name(v),
    ),
    StageSpec(
        "rollout",
        files=("rollouts.parquet",),
        reads=_ROLLOUT,
        reads_if=_agent,
        takes=RolloutInputs,
        replayable=True,
    ),
    StageSpec(
        "reward",
        files=("rewards.parquet",),
        reads=_REWARD,
        reads_if=_reward_extra,
        takes=RewardInputs,
        replayable=True,
    ),
    StageSpec(
        "filter_groups",  # DAPO's dynamic sampling: generates and scores its extra rounds as the two stages above
        files=("groups.parquet", "rollouts.parquet", "rewards.parquet", "extra_rollouts.parquet", "extra_rewards.parquet"),
        reads=(*_ROLLOUT, *_REWARD, "algorithm.filter_groups"),
        reads_if=lambda v: _agent(v) + _reward_extra(v),
        when=lambda v: v.algorithm.filter_groups.enable,
        takes=FilterGroupsInputs,  # its artifact stands for the rollouts and rewards in the stages after it
        replayable=True,
    ),
    StageSpec(
        "advantage",
        files=("experience.parquet",),
        reads=(
            "algorithm", "rollout.temperature", "rollout.max_logprob_gap", "rollout.engine", "critic.enable",
            *_ACTOR_PASS, *_WORKER,
        ),  # fmt: skip
        reads_if=lambda v: _CRITIC_PASS if v.critic.enable else (),
        # an estimator that needs sum pi^2 gets it from the old-log-prob pass (config load requires the flag)
        reads_if_needs=(
            NeedRead("advantage estimator", "algorithm.adv_estimator.name", "sum_pi_squared", ("actor.calculate_sum_pi_squared",)),
        ),
        takes=AdvantageInputs,
        replayable=True,
    ),
    StageSpec(
        "critic",
        files=("metrics.parquet",),
        reads=(*_CRITIC_TRAIN, "trainer.seed", *_WORKER),
        reads_if=lambda v: _TOTAL_STEPS if _decays(v.critic.optim) else (),
        takes=CriticInputs,
        output_ref=True,
    ),
    StageSpec(
        "update",
        files=("metrics.parquet",),
        reads=(
            "actor", "rollout.temperature", "trainer.seed", "trainer.checkpoint_every", "critic.enable",
            "critic.warmup_iterations", *_WORKER,
            # mirrored into actor.rollout_correction at config load (verl's layout); the loss reads it there
            "algorithm.rollout_correction",
        ),  # fmt: skip
        reads_if=lambda v: _TOTAL_STEPS if _decays(v.actor.optim) else (),
        takes=UpdateInputs,
        output_ref=True,
        replayable=True,
    ),
    StageSpec(
        "eval",
        files=("eval.parquet",),
        reads=("data.eval_size", "trainer.eval_n", *_SAMPLING, *_ENGINE, "agent.enable", "reward", *_WORKER),
        reads_if=_eval_extra,
        takes=EvalInputs,
        phase="eval",
        replayable=True,
    ),
)

STAGE_SPECS: dict[str, StageSpec] = {s.name: s for s in SPECS}
STAGES = tuple(STAGE_SPECS)
# The main Parquet file each per-iteration stage commits (the update stage also commits a model directory).
STAGE_FILES = {s.name: s.files[0] for s in SPECS if s.per_iteration}
REPLAYABLE = tuple(s.name for s in SPECS if s.replayable)


def spec(stage: str) -> StageSpec:
    if stage not in STAGE_SPECS:
        raise KeyError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
    return STAGE_SPECS[stage]


def covers(path: str, paths: tuple[str, ...]) -> bool:
    """Whether the declared ``paths`` cover the dotted ``path`` (a section path covers its settings)."""
    return any(path == p or path.startswith(p + ".") for p in paths)


class ConfigView:
    """A read-only view of a run config for one stage: its declared paths and the execution sections.

    Reading any other setting raises ``UndeclaredConfigRead`` naming the stage and the path.
    """

    __slots__ = ("_node", "_stage", "_paths", "_prefix")

    def __init__(self, node: BaseModel, stage: str, paths: tuple[str, ...], prefix: str = "") -> None:
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_paths", paths)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle protocol probes: a view is not a value to copy
            raise AttributeError(name)
        path = self._prefix + name
        allowed = (not self._prefix and name in EXECUTION) or covers(path, self._paths)
        if name in type(self._node).model_fields:
            value = getattr(self._node, name)
            # a section: checked at the setting read from it; a declared entry's section (a name and the settings
            # its registry entry validates, e.g. actor.policy_loss) is read whole, as its keys are not fields
            if isinstance(value, BaseModel) and not (allowed and value.model_config.get("extra") == "allow"):
                return ConfigView(value, self._stage, (path,) if allowed else self._paths, path + ".")
            if allowed:
                return value
        raise UndeclaredConfigRead(
            f"stage {self._stage!r} read config {path!r}, which its view does not declare "
            f"(schemas/stages.py: add it to the stage's reads, so its cache key hashes it)"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"stage {self._stage!r}: the config view is read-only (tried to set {self._prefix + name})")

    def __repr__(self) -> str:
        return f"ConfigView({self._stage!r}, {self._prefix or '<root>'}: {', '.join(self._paths)})"


def whole_config(cfg: RunConfig | ConfigView) -> RunConfig:
    """The run config behind a view: for the execution plumbing only (the policy worker is started from
    the whole config; what it reads for each stage is declared in that stage's view)."""
    if isinstance(cfg, ConfigView):
        if cfg._prefix:
            raise TypeError(f"whole_config needs a stage's root view, got the {cfg._prefix[:-1]} section")
        return cfg._node  # type: ignore[return-value]
    return cfg


def _dotted(node: Any, path: str) -> Any:
    for part in path.split("."):
        node = getattr(node, part)
    return node


def view_paths(cfg: RunConfig | ConfigView, stage: str, needs: EntryNeeds | None = None) -> tuple[str, ...]:
    """The dotted paths stage ``stage`` may read under ``cfg``: its reads plus those its settings add, and those the
    needs of the registry entries it names add (``needs``: the registries' answer, required for such a stage)."""
    s, whole = spec(stage), whole_config(cfg)
    paths = s.reads
    if s.reads_if is not None:
        paths = paths + s.reads_if(ConfigView(whole, stage, s.reads))
    for r in s.reads_if_needs:
        if needs is None:
            raise RuntimeError(
                f"the view of stage {stage!r} depends on what the {r.kind} at {r.name} needs: pass needs= "
                "(rlstage.engines.registry.needs_of)"
            )
        if r.need in needs(r.kind, _dotted(whole, r.name)):
            paths = paths + r.paths
    return tuple(sorted(set(paths)))


def stage_view(cfg: RunConfig | ConfigView, stage: str, needs: EntryNeeds | None = None) -> ConfigView:
    return ConfigView(whole_config(cfg), stage, view_paths(cfg, stage, needs))


def view_hash(cfg: RunConfig | ConfigView, stage: str, needs: EntryNeeds | None = None) -> str:
    """What a stage's output depends on in the config: the hash of exactly its view (the one given,
    when ``cfg`` is that stage's view)."""
    own = isinstance(cfg, ConfigView) and cfg._stage == stage and not cfg._prefix
    return whole_config(cfg).stage_hash(*(cfg._paths if own else view_paths(cfg, stage, needs)))


def kit_run_name(cfg: RunConfig | ConfigView) -> str:
    """The kit's own run, shared by every run with the same SFT view (kit, sft, and the agent for multiply)."""
    return f"kit-{view_hash(cfg, 'sft')}"
