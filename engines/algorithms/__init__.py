"""The RL math of rlstage: advantage estimators, policy losses, loss aggregation, KL terms, rollout
correction and DAPO's overlong reward shaping.

One module each: ``advantages`` (estimators), ``loss_registry`` (how a policy loss registers, its
settings model), ``losses`` (the built-in policy losses and the value loss), ``aggregation``
(``agg_loss``), ``kl`` (estimators, controllers, the penalty in the reward), ``correction`` (rollout
importance weights) and ``masked`` (masked reductions, group statistics); this package re-exports them.

Pure torch (plus numpy-compatible group ids), no Prefect, no Ray. Everything that a config picks
by name lives in a registry (``ADV_ESTIMATORS``, ``POLICY_LOSSES``, ``LOSS_AGG_MODES``, ``KL_TYPES``:
engines/registry.py), and the conventions follow verl 0.9.1
(``verl/trainer/ppo/core_algos.py`` and ``verl/utils/torch_functional.py``).

Shapes and masks
    Token tensors (``token_level_rewards``, ``response_mask``, ``values``, ``log_prob``, ``old_log_prob``,
    ``ref_log_prob``, ``advantages``) are ``[batch, response_len]``, right-padded. ``response_mask`` is 1 on
    tokens the policy generated and 0 elsewhere; in multi-turn tool calling it may have gaps inside a
    response (``1 1 0 0 1 1 0``). Nothing here looks for "the end" of a response: every formula reads the
    mask position by position, so gaps and right padding are the same case.
    ``index`` holds one group id per row (rows sampled from the same prompt share an id); any hashable
    values work, in a list or a numpy array.
"""

from __future__ import annotations

from rlstage.engines.algorithms.advantages import (
    ADV_ESTIMATORS,
    adv_estimator_settings,
    check_estimator_reads,
    compute_advantage,
    gae_advantage,
    gdpo_advantage,
    get_adv_estimator,
    gpg_advantage,
    grpo_advantage,
    grpo_passk_advantage,
    opo_advantage,
    optimal_token_baseline_advantage,
    overlong_penalty,
    register_adv_estimator,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    rloo_vectorized_advantage,
    tir_optimal_token_baseline_advantage,
)
from rlstage.engines.algorithms.aggregation import (
    LOSS_AGG_MODES,
    AggNorm,
    agg_loss,
    agg_norm,
    register_loss_agg_mode,
)
from rlstage.engines.algorithms.correction import (
    ROLLOUT_IS_LEVELS,
    SAFETY_BOUND,
    offpolicy_metrics,
    rollout_correction,
)
from rlstage.engines.algorithms.kl import (
    KL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    register_kl_penalty,
)
from rlstage.engines.algorithms.loss_registry import (
    POLICY_LOSSES,
    LossSettings,
    actor_needs_ref,
    fixed_pg_agg,
    get_policy_loss,
    needs_reference,
    policy_loss_settings,
    register_policy_loss,
)
from rlstage.engines.algorithms.losses import (
    compute_value_loss,
    policy_loss_bypass_mode,
    policy_loss_cispo,
    policy_loss_clip_cov,
    policy_loss_dppo_kl,
    policy_loss_dppo_tv,
    policy_loss_dro,
    policy_loss_geo_mean,
    policy_loss_gpg,
    policy_loss_gspo,
    policy_loss_kl_cov,
    policy_loss_reinforce,
    policy_loss_sapo,
    policy_loss_vanilla,
)
from rlstage.engines.algorithms.masked import (
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AdaptiveKLController",
    "AggNorm",
    "FixedKLController",
    "KLController",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "LossSettings",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "SAFETY_BOUND",
    "actor_needs_ref",
    "fixed_pg_agg",
    "adv_estimator_settings",
    "check_estimator_reads",
    "agg_loss",
    "agg_norm",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "gae_advantage",
    "gdpo_advantage",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "gpg_advantage",
    "grpo_advantage",
    "grpo_passk_advantage",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_reference",
    "offpolicy_metrics",
    "opo_advantage",
    "optimal_token_baseline_advantage",
    "overlong_penalty",
    "policy_loss_bypass_mode",
    "policy_loss_cispo",
    "policy_loss_clip_cov",
    "policy_loss_dppo_kl",
    "policy_loss_dppo_tv",
    "policy_loss_dro",
    "policy_loss_geo_mean",
    "policy_loss_gpg",
    "policy_loss_gspo",
    "policy_loss_kl_cov",
    "policy_loss_reinforce",
    "policy_loss_sapo",
    "policy_loss_settings",
    "policy_loss_vanilla",
    "register_adv_estimator",
    "register_kl_penalty",
    "register_loss_agg_mode",
    "register_policy_loss",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
    "rloo_vectorized_advantage",
    "rollout_correction",
    "tir_optimal_token_baseline_advantage",
]
