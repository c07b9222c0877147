"""The config sections of what a run trains: optimizer, rollout correction, the named entries (policy loss,
estimator), the actor, the critic and the algorithm."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlstage.schemas.config.base import FLAT_LOSS, HASHED_WHEN_SET, _Section, parse_is_threshold


class OptimConfig(_Section):
    lr: float = Field(1e-4, gt=0)  # AdamW's peak learning rate
    weight_decay: float = Field(0.0, ge=0)  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates
    warmup_steps: int = Field(0, ge=0)  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up: constant, or cosine / linear decay to min_lr_ratio x lr over total_steps
    total_steps: int | None = Field(None, ge=1)  # for decaying schedules; None: derived from the run
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # the decayed schedule's floor, as a share of lr
    grad_clip: float = Field(1.0, gt=0)  # gradient-norm clipping threshold
    # torch's fused AdamW kernel (CPU and CUDA): a third of the tiny model's optimizer step; its results differ
    # from the default loop's in the last bit, so runs stored without it keep replaying bit for bit.
    fused: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)


class RolloutCorrectionConfig(_Section):
    """Train/inference mismatch correction (verl's ``algorithm.rollout_correction``, README: rollout correction).

    ``rollout_is``: None (off), ``token`` or ``sequence`` importance weights pi_train / pi_rollout;
    ``rollout_is_threshold``: a number truncates the weights there (TIS), ``"low_high"`` zeroes weights
    outside the band (IcePop); ``rollout_is_batch_normalize`` rescales them to mean 1. ``bypass_mode``
    trains against the rollout's log-probs as the old policy with ``loss_type`` ``ppo_clip`` or
    ``reinforce``. Rejection sampling (verl's ``rollout_rs``) is not implemented. Quote an IcePop band in
    YAML and in overrides (``'0.5_2.0'``): unquoted, YAML reads ``0.5_2.0`` as the number 0.52.
    """

    rollout_is: Literal["token", "sequence"] | None = None  # importance weights pi_train / pi_rollout per token or per sequence (None: off)
    rollout_is_threshold: float | str = 2.0  # a number truncates the weights there (TIS); "low_high" zeroes weights outside the band (IcePop)
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    bypass_mode: bool = False  # the rollout's log-probs are the old policy (no recompute by the trainer)
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"  # bypass mode's loss: ppo_clip or reinforce

    @field_validator("rollout_is_threshold")
    @classmethod
    def _threshold(cls, v: float | str) -> float | str:
        parse_is_threshold(v)
        return v

    @property
    def enabled(self) -> bool:
        """The update needs the rollout's log-probs (IS weights or bypass mode)."""
        return self.rollout_is is not None or self.bypass_mode


class NamedEntryConfig(BaseModel):
    """A registered entry named by the config: its ``name`` and its own settings beside it (verl's PolicyLossConfig);
    a plain string is the name alone.

    The settings are kept as given: engines/preflight.py validates them against the entry's registered settings
    model (a plugin's too, which schemas cannot import) and the engine receives that typed model.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str

    @model_validator(mode="before")
    @classmethod
    def _plain_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @property
    def settings(self) -> dict[str, Any]:
        """The settings given beside the name."""
        return dict(self.model_extra or {})


class PolicyLossConfig(NamedEntryConfig):
    """``actor.policy_loss``: a registered loss's ``name`` and its own settings beside it (verl's PolicyLossConfig)."""

    name: str = "vanilla"  # a registered policy loss (vanilla: PPO's clip; gspo, sapo, a plugin's, ...); its settings sit beside it


class AdvEstimatorConfig(NamedEntryConfig):
    """``algorithm.adv_estimator``: a registered estimator's ``name`` and its own settings beside it (a plugin's).

    The built-in estimators take none: they read verl's flat ``algorithm.gamma``, ``lam`` and ``norm_adv_by_std_in_grpo``.
    """

    name: str = "grpo"  # a registered advantage estimator (grpo, rloo, gae, a plugin's, ...); its settings sit beside it


class ActorConfig(_Section):
    engine: Literal["torch", "deepspeed"] = "torch"  # torch (a plain loop; data parallel by one all-reduce a step) or deepspeed (ZeRO)
    zero_stage: int = Field(0, ge=0, le=3)  # engine=deepspeed: ZeRO stage (1: optimizer state sharded; 2: and gradients; 3: and weights)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = Field(64, ge=1)  # samples per optimizer step
    micro_batch_size: int = Field(64, ge=1)  # samples per forward/backward
    # Tokens per forward/backward instead of a sample count (padding included unless packing); losses are
    # then weighted so the accumulated gradient equals the whole mini-batch's. None: micro_batch_size.
    micro_batch_tokens: int | None = Field(None, ge=1)
    packing: bool = False  # a micro-batch's sequences in one row, no padding, position ids per sequence
    # The samples of one prompt in a micro-batch share the prompt's forward (its key/value cache), as GRPO's n
    # samples per prompt would otherwise each recompute it; padded layout only.
    share_prompts: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    # Response log-probs and entropy from the last hidden states, this many tokens of the output layer at a time,
    # the backward recomputing each chunk's logits: no [tokens, vocabulary] fp32 tensor is kept for a micro-batch of
    # more tokens than this (the same numbers up to float rounding). None: the whole micro-batch's logits at once.
    logits_chunk_tokens: int | None = Field(512, ge=1, json_schema_extra=HASHED_WHEN_SET)
    ppo_epochs: int = Field(1, ge=1)  # passes over each iteration's batch
    # A registered loss: its name (a string), or its name and settings ({name: gspo, clip_ratio_low: 0.2}).
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"  # a registered aggregation mode
    # verl's loss_scale_factor: the constant seq-mean-token-sum-norm divides by (e.g. the longest possible response);
    # None: the padded width of what it reduces (the mini-batch's, or with a fixed micro_batch_size each micro-batch's).
    loss_scale_factor: int | None = Field(None, ge=1, json_schema_extra=HASHED_WHEN_SET)
    # Copied from algorithm.rollout_correction at load (verl hands it to the actor the same way): set it there.
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    entropy_coeff: float = 0.0  # weight of the entropy bonus (0: logged, not differentiated)
    use_kl_loss: bool = False  # a KL term to the reference policy in the loss (GRPO's) instead of in the reward
    kl_loss_coef: float = Field(0.001, ge=0)  # the KL loss's weight
    kl_loss_type: str = "low_var_kl"  # a registered KL penalty
    shuffle: bool = True  # shuffle samples between mini-batches
    # A mini-batch holds whole prompt groups (the shuffle moves a prompt's samples together), as verl's mini-batches
    # of ppo_mini_batch_size prompts x n: with share_prompts each prompt's forward is then shared by all its samples.
    group_mini_batches: bool = Field(False, json_schema_extra=HASHED_WHEN_SET)
    # The old-log-prob pass also returns sum_v pi_v^2 per token (optimal_token_baseline needs it), as verl's.
    calculate_sum_pi_squared: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nest_loss_settings(cls, data: Any) -> Any:
        # A plain name is a loss without settings; the flat names of 0.1 move under policy_loss (read for one release).
        if isinstance(data, dict) and isinstance(data.get("policy_loss"), str):
            data = {**data, "policy_loss": {"name": data["policy_loss"]}}
        return FLAT_LOSS.nest(data)

    @model_validator(mode="after")
    def _layout(self) -> ActorConfig:
        if self.share_prompts and self.packing:
            raise ValueError("share_prompts needs the padded layout: packing must be false")
        return self


class CriticConfig(_Section):
    """The value model (for ``gae``): initialised from the starting policy with a fresh value head."""

    enable: bool = False  # train a value model (needed by the gae estimator)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    cliprange_value: float = Field(0.5, gt=0)  # PPO's value clipping: a value moves at most this far from the old one
    ppo_mini_batch_size: int = Field(64, ge=1)  # samples per critic optimizer step
    micro_batch_size: int = Field(64, ge=1)  # samples per critic forward/backward
    micro_batch_tokens: int | None = Field(None, ge=1)  # as actor.micro_batch_tokens
    packing: bool = False  # as actor.packing
    ppo_epochs: int = Field(1, ge=1)  # passes over each batch
    loss_agg_mode: str = "token-mean"  # a registered aggregation mode (as actor.loss_agg_mode)
    warmup_iterations: int = Field(0, ge=0)  # iterations that train only the critic
    shuffle: bool = True  # shuffle samples between mini-batches


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"  # fixed coefficient, or adaptive towards target_kl
    kl_coef: float = Field(0.001, ge=0)  # the (initial) KL coefficient
    target_kl: float = Field(0.1, gt=0)  # adaptive: the KL the coefficient steers towards
    horizon: int = Field(10000, ge=1)  # adaptive: how slowly the coefficient moves (verl's horizon)


class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``, engines/data/dynamic_sampling.py): groups whose
    ``metric`` is equal for all samples are dropped and more prompts generated, up to ``max_num_gen_batches``
    generation rounds in all (verl's default 0 means no cap there; here a cap is required)."""

    enable: bool = False  # DAPO's dynamic sampling: drop groups whose samples all score alike, generate more
    # a key of rlstage.engines.data.dynamic_sampling.FILTER_METRICS (checked there, by engines/preflight.py)
    metric: str = "acc"
    max_num_gen_batches: int = Field(0, ge=0)  # generation rounds per iteration at most (a cap is required when enabled)


class AlgorithmConfig(_Section):
    """verl's ``algorithm`` section. Its flat estimator settings (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``) are
    read by the estimators whose registry entry declares them; another value than the default of one the chosen
    estimator does not read is refused at load."""

    # A registered estimator: its name (a string), or its name and its own settings ({name: my_est, foo: 1}).
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    norm_adv_by_std_in_grpo: bool = True  # GRPO divides advantages by the group's std (false: Dr. GRPO)
    gamma: float = Field(1.0, ge=0, le=1)  # the discount of gae (and of REINFORCE++'s returns)
    lam: float = Field(1.0, ge=0, le=1)  # gae's lambda
    use_kl_in_reward: bool = False  # subtract a KL penalty to the reference from the token rewards (kl_ctrl's coefficient)
    kl_penalty: str = "kl"  # a registered KL penalty
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)


# verl's estimator settings, flat under algorithm.: an estimator reads those its signature names (engines/algorithms).
FLAT_ESTIMATOR_SETTINGS = ("norm_adv_by_std_in_grpo", "gamma", "lam")
# verl's aggregation settings, flat under actor.: an aggregation mode's registry entry declares those it reads.
FLAT_AGG_SETTINGS = ("loss_scale_factor",)
