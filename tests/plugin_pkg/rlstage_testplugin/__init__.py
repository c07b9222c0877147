"""Importing this module registers a policy loss (``scaled_pg``, with a settings model), an advantage estimator
(``grpo_median``) and a reward function (``even_last_digit``), as a third party's plugin would."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlstage.engines.algorithms import agg_loss, masked_mean, register_adv_estimator, register_policy_loss
from rlstage.engines.rewards.rules import register_reward_fn


class ScaledPGSettings(BaseModel):
    """``actor.policy_loss: {name: scaled_pg, scale: ...}``."""

    model_config = ConfigDict(extra="forbid")

    scale: float = Field(1.0, gt=0)  # multiplies the loss (and so the step)


@register_policy_loss("scaled_pg", settings=ScaledPGSettings)
def scaled_pg(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="token-mean",
    *,
    scale=1.0,
    agg=None,
    **kw,
):
    """The unclipped importance-weighted policy gradient ``-A * exp(log_prob - old_log_prob)``, times ``scale``."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    losses = -advantages * torch.exp(log_ratio) * scale
    loss = agg_loss(losses, mask, loss_agg_mode, **({} if agg is None else agg.agg_kwargs()))
    return loss, {"ppo_kl": masked_mean(-log_ratio, mask).detach(), "scaled_pg/scale": torch.tensor(scale)}


@register_reward_fn("even_last_digit")
def even_last_digit(response_text: str, ground_truth: str, extra_info: dict) -> float:
    """1 when the response ends in an even digit: a task an untrained policy gets partly right."""
    text = response_text.strip()
    return 1.0 if text[-1:] in ("0", "2", "4", "6", "8") else 0.0


@register_adv_estimator("grpo_median", needs=("groups",))
@torch.no_grad()
def grpo_median(*, token_level_rewards, response_mask, index, **kw):
    """Each response's score minus its group's median (the rows of one prompt share an ``index``), broadcast over
    its tokens and zero off the mask; returns ``(advantages, returns)``, both ``[batch, length]``."""
    scores = token_level_rewards.sum(dim=-1)
    group = torch.tensor([list(dict.fromkeys(index)).index(key) for key in index])
    baseline = torch.stack([scores[group == g].median() for g in group.tolist()])
    advantages = (scores - baseline)[:, None] * response_mask
    return advantages, advantages
