"""A policy loss: PPO's clipped surrogate plus a quadratic penalty on the log-ratio (a soft trust region).

``actor.policy_loss: {name: ppo_l2, clip_ratio: 0.2, l2_coef: 0.1}``.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlstage.engines.algorithms import agg_loss, masked_mean, register_policy_loss


class PPOL2Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_ratio: float = Field(0.2, gt=0)  # the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio]
    l2_coef: float = Field(0.1, ge=0)  # weight of (log_prob - old_log_prob)^2


@register_policy_loss("ppo_l2", settings=PPOL2Settings)
def ppo_l2(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    clip_ratio,
    l2_coef,
    rollout_is_weights=None,
    agg=None,
    **kw,
):
    """Per token, with ``d = log_prob - old_log_prob`` and ``r = exp(d)``:
    ``L = max(-A r, -A clip(r, 1 - clip_ratio, 1 + clip_ratio)) + l2_coef * d^2``, times the rollout
    correction weights when given, then aggregated by ``loss_agg_mode``. Returns ``(loss, metrics)``."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)  # exp stays finite
    ratio = torch.exp(log_ratio)
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    losses = surrogate + l2_coef * log_ratio.square()
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    loss = agg_loss(losses, mask, loss_agg_mode, **({} if agg is None else agg.agg_kwargs()))
    clipped = ((ratio - 1).abs() > clip_ratio).to(mask.dtype)
    return loss, {
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),  # verl's metric names, logged under actor/
        "pg_clipfrac": masked_mean(clipped, mask).detach(),
        "ppo_l2/penalty": masked_mean(log_ratio.square(), mask).detach(),  # a name with "/" is logged as it is
    }
