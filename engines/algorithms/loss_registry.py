"""How a policy loss is registered (verl's ``register_policy_loss``): the registry, each loss's settings model and
what a loss needs; the built-in losses register themselves in ``losses``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from rlstage.engines.registry import Registry, settings_for
from rlstage.schemas.config import FLAT_LOSS_SETTINGS

Tensor = torch.Tensor
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


# ====================================================================== the registry
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")



@dataclass(frozen=True)
class LossTraits:
    """What a policy loss's registration declares besides its settings and needs."""

    # the aggregation it uses whatever loss_agg_mode says (see its docstring); None: it follows loss_agg_mode.
    # "row-mean" is geo_mean's own mean over all rows of the batch, empty ones included (computed in the loss).
    fixed_agg: str | None = None


# ---------------------------------------------------------------------- settings
# Each loss's own settings (actor.policy_loss.<setting>), named and defaulted as verl's actor config; the defaults are
# those the settings had when they sat flat in the actor section (schemas.config.FLAT_LOSS_SETTINGS).
def loss_default(name: str) -> Any:
    """The default of a built-in loss setting, declared once (the loss functions' keyword defaults read it too)."""
    return FLAT_LOSS_SETTINGS[name]


def _default(name: str, **constraints: Any) -> Any:
    return Field(loss_default(name), **constraints)


class LossSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClipRange(LossSettings):
    clip_ratio_low: float = _default("clip_ratio_low", ge=0)
    clip_ratio_high: float = _default("clip_ratio_high", ge=0)


class PPOClip(ClipRange):
    clip_ratio_c: float = _default("clip_ratio_c", gt=1.0)  # dual-clip bound of negative advantages


class SapoSettings(LossSettings):
    tau_pos: float = _default("tau_pos", gt=0)  # gate temperature where A > 0
    tau_neg: float = _default("tau_neg", gt=0)  # where A <= 0


class ClipCovSettings(ClipRange):
    clip_cov_ratio: float = _default("clip_cov_ratio", gt=0)  # share of tokens whose gradient is dropped
    clip_cov_lb: float = _default("clip_cov_lb")  # covariance band of the candidates
    clip_cov_ub: float = _default("clip_cov_ub")


class KLCovSettings(LossSettings):
    kl_cov_ratio: float = _default("kl_cov_ratio", gt=0)  # share of tokens given the KL penalty
    ppo_kl_coef: float = _default("ppo_kl_coef", ge=0)  # coefficient of that penalty


class DROSettings(LossSettings):
    dro_beta: float = Field(gt=0)  # the quadratic log-ratio penalty: required


def register_policy_loss(
    name: str, *, settings: type[BaseModel] | None = None, needs: Iterable[str] = (), fixed_agg: str | None = None
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` with the model of its own ``settings`` (a pydantic model
    the config's ``actor.policy_loss`` section is validated against; None: it takes none) and what it ``needs``
    (``ref``: the reference policy's log-probs come as ``ref_log_prob``, ``[batch, len]``).

    Signature: ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
    rollout_is_weights=None, agg=None, **settings_and_kw) -> (loss, metrics)``; the settings come as keywords
    named as in the settings model, with ``generator`` (seeded per update) and, when rollout correction is on,
    more keywords a loss ignores through ``**kw``. ``rollout_is_weights`` (detached, ``[batch, len]``) multiply
    the per-token losses before aggregation. Metrics are detached scalars, named as verl names them without the
    ``actor/`` prefix (keys holding a ``/`` are logged as they are, e.g. ``rollout_corr/...``). ``fixed_agg``: the
    aggregation the loss uses whatever ``loss_agg_mode`` says (None: it follows ``loss_agg_mode``).
    """
    return POLICY_LOSSES.register(name, settings=settings, needs=needs, traits=LossTraits(fixed_agg))


def fixed_pg_agg(name: str) -> str | None:
    """The aggregation policy loss ``name`` declares it uses whatever ``loss_agg_mode`` says (None: it follows it)."""
    traits = POLICY_LOSSES.entry(name).traits
    return traits.fixed_agg if isinstance(traits, LossTraits) else None


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered policy loss called ``name``; ValueError naming the registered ones otherwise."""
    return POLICY_LOSSES.entry(name).obj


def actor_needs_ref(actor: Any) -> bool:
    """The update reads the reference policy's log-probs (``actor`` is the config's actor section): for a KL loss,
    or for a policy loss registered with ``needs=("ref",)``, which then receives them as ``ref_log_prob``."""
    return actor.use_kl_loss or "ref" in POLICY_LOSSES.entry(actor.policy_loss.name).needs


def needs_reference(cfg: Any) -> bool:
    """The run needs a frozen reference policy: KL in the reward (``RunConfig.needs_ref``, which schemas can answer
    alone) or an update that reads it (``actor_needs_ref``, which asks the loss's registry entry)."""
    return cfg.needs_ref or actor_needs_ref(cfg.actor)


def policy_loss_settings(section: Any) -> LossSettings | None:
    """The typed settings of ``actor.policy_loss`` (a ``PolicyLossConfig``: a name and the settings given beside it),
    validated against the loss's registered model; ValueError with one line naming the setting otherwise."""
    return settings_for(POLICY_LOSSES.entry(section.name), section.settings, "actor.policy_loss")
