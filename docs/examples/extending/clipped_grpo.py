"""An advantage estimator: GRPO's group-normalised score, clipped to ``[-max_abs, max_abs]``.

``algorithm.adv_estimator: {name: clipped_grpo, max_abs: 2.0}``; rollout.n >= 2 (it ``needs`` groups).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlstage.engines.algorithms import register_adv_estimator


class ClippedGRPOSettings(BaseModel):
    """Its own settings, nested under its name in the config (the only place their defaults live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs: float = Field(2.0, gt=0)  # the largest advantage, in group standard deviations


@register_adv_estimator("clipped_grpo", needs=("groups",), settings=ClippedGRPOSettings)
@torch.no_grad()
def clipped_grpo(*, token_level_rewards, response_mask, index, max_abs, epsilon=1e-6, **kw):
    """Per response ``s_i = sum_t r_it``; within its group (the rows of one prompt share an ``index``)
    ``A_i = clip((s_i - mean) / (std + epsilon), -max_abs, max_abs)``, broadcast over its tokens and zero
    off the mask. A one-member group gets 0. Returns ``(advantages, returns)``, both ``[batch, length]``."""
    scores = token_level_rewards.sum(dim=-1)
    groups: dict = {}
    for row, key in enumerate(index):
        groups.setdefault(key, []).append(row)
    adv = torch.zeros_like(scores)
    for rows in groups.values():
        s = scores[rows]
        if len(rows) > 1:
            adv[rows] = (s - s.mean()) / (s.std() + epsilon)
    adv = adv.clamp(-max_abs, max_abs).unsqueeze(-1) * response_mask.to(scores.dtype)
    return adv, adv
