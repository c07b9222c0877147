"""KL estimators, the KL controllers and the KL penalty in the reward (verl's ``apply_kl_penalty``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlstage.engines.algorithms.masked import masked_mean
from rlstage.engines.registry import Registry

Tensor = torch.Tensor


# ====================================================================== KL
# A KL penalty: ``fn(log_prob, ref_log_prob) -> [batch, len]`` estimate of KL(pi || pi_ref) per token. Registering
# ``name`` registers ``name+`` too: the same value with k2's gradient (straight-through, see kl_penalty).
KLPenaltyFn = Callable[[Tensor, Tensor], Tensor]
KL_TYPES: Registry[KLPenaltyFn] = Registry("KL penalty")


def register_kl_penalty(*names: str) -> Callable[[KLPenaltyFn], KLPenaltyFn]:
    """Decorator: register a per-token KL estimate under ``names`` (aliases) and each ``name+``."""

    def deco(fn: KLPenaltyFn) -> KLPenaltyFn:
        for name in names:
            KL_TYPES.add(name, fn, needs=("ref",))
        for name in names:
            KL_TYPES.add(f"{name}+", _k2_gradient(fn), needs=("ref",), module=fn.__module__)
        return fn

    return deco


def _k2_gradient(fn: KLPenaltyFn) -> KLPenaltyFn:
    def straight_through(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
        k2 = 0.5 * (log_prob - ref_log_prob).square()
        return k2 - k2.detach() + fn(log_prob, ref_log_prob).detach()

    straight_through.__qualname__ = f"{fn.__qualname__}+"
    straight_through.__doc__ = f"{(fn.__doc__ or '').split(':')[0]}'s value with k2's gradient (straight-through): an unbiased KL gradient."
    return straight_through


@register_kl_penalty("kl", "k1")
def _k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1: log pi - log pi_ref per token; unbiased, can be negative (verl's kl, the in-reward default)."""
    return log_prob - ref_log_prob


@register_kl_penalty("abs")
def _abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """abs: |log pi - log pi_ref| per token; never negative, biased."""
    return (log_prob - ref_log_prob).abs()


@register_kl_penalty("mse", "k2")
def _k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2: half the squared log-ratio per token; its gradient is the KL's in expectation."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_penalty("low_var_kl", "k3")
def _k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3: exp(-d) + d - 1 of the log-ratio d, clamped as verl; low variance, never negative (GRPO's KL loss)."""
    # clamp the exponent (±20) and then the estimate (±10), both as verl, for stability
    d = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1, min=-10.0, max=10.0)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman's k1/k2/k3).

    With ``d = log_prob - ref_log_prob``:

    - ``kl`` / ``k1``: ``d`` (unbiased value, can be negative per token);
    - ``abs``: ``|d|``;
    - ``mse`` / ``k2``: ``0.5 * d**2``;
    - ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` with ``-d`` clamped to [-20, 20] before the exp and the
      result clamped to [-10, 10].

    A ``+`` suffix (``k3+``, ``low_var_kl+``, ``kl+``, ...) keeps the forward VALUE of the base estimator
    but takes the GRADIENT of k2 (whose expected gradient is the gradient of the KL), straight-through:
    ``k2 - sg(k2) + sg(k)``. ``mse+`` / ``k2+`` equal ``k2``. Nothing is masked here.
    """
    return KL_TYPES.entry(kl_penalty).obj(log_prob, ref_log_prob)


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    kind = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: a fixed coefficient ignores the observed KL."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. (2019), as in verl and TRL.

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``, where
    ``n_steps`` is the number of samples (rows) behind ``current_kl``.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


KLController = FixedKLController | AdaptiveKLController


def _check_kind(kind: str, state: dict[str, Any]) -> None:
    if state.get("kind", kind) != kind:
        raise ValueError(f"state of a {state['kind']!r} KL controller loaded into a {kind!r} one")


def get_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: fixed, adaptive")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kl_penalty_type: str,
) -> tuple[Tensor, dict[str, float]]:
    """KL-in-reward: ``rewards = scores - beta * kl_penalty(old, ref) * mask`` and a controller step.

    ``beta`` is the controller's value BEFORE this step's update. The observed KL is the mean over rows
    of each row's token mean of the masked estimate (an empty row counts as 0); the controller is then
    updated with it and ``n_steps`` = number of rows. Metrics: ``actor/reward_kl_penalty`` (that KL)
    and ``actor/reward_kl_penalty_coeff`` (the beta used).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type)
    kld = torch.where(mask.bool(), kld, torch.zeros_like(kld)) * mask
    beta = float(kl_ctrl.value)
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean().item())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
