"""The built-in policy losses, registered by name (``loss_registry``), and PPO's clipped value loss."""

from __future__ import annotations

from typing import Any

import torch

from rlstage.engines.algorithms.aggregation import AggNorm, _global, agg_loss
from rlstage.engines.algorithms.correction import rollout_correction
from rlstage.engines.algorithms.loss_registry import (
    ClipCovSettings,
    ClipRange,
    DROSettings,
    KLCovSettings,
    PPOClip,
    SapoSettings,
    fixed_pg_agg,
    loss_default,
    register_policy_loss,
)
from rlstage.engines.algorithms.masked import masked_mean, masked_sum

Tensor = torch.Tensor


# ====================================================================== policy losses
def _metrics(pg_clipfrac: Tensor, ppo_kl: Tensor, pg_clipfrac_lower: Tensor) -> dict[str, Tensor]:
    return {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }


def _weighted(pg_losses: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    # Rollout-correction weights change the measure, not the objective: they never carry a gradient.
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach()


def _zero(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


@register_policy_loss("vanilla", settings=PPOClip)
def policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_ratio_c: float = loss_default("clip_ratio_c"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual-clip.

    ``d = clamp(log_prob - old_log_prob, -20, 20)`` (clamped before ``exp`` so the ratio stays finite),
    ``r = exp(d)``; per token::

        L1 = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L  = min(L1, -A clip_ratio_c)   where A < 0      (dual-clip, Ye et al. 2019)
        L  = L1                         where A >= 0

    Dual-clip only ever bounds the loss of NEGATIVE advantages (``clip_ratio_c > 1`` required).
    Times the rollout IS weights if given, then ``agg_loss(L, response_mask, loss_agg_mode)``. Metrics
    (token-mean over the mask): ``pg_clipfrac`` = share of tokens where the clipped term is the larger one,
    ``pg_clipfrac_lower`` = share of negative-advantage tokens where dual-clip bit, ``ppo_kl`` = masked
    mean of ``-d``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(clipped, loss3) & negative).to(mask.dtype), mask)
    pg_losses = _weighted(torch.where(negative, dual, clipped), rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **_global(agg))
    return loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _dppo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    valid: Tensor,
    clip_ratio_c: float,
    rollout_is_weights: Tensor | None,
    agg: AggNorm | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The shared part of DPPO: truncated-IS policy gradient on the tokens ``valid`` keeps."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    keep = valid.detach().to(mask.dtype)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    pg_losses = _weighted(-advantages * truncated * log_prob * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **_global(agg))
    pg_clipfrac = masked_mean(1.0 - keep, mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(mask.dtype) * keep, mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, mask), pg_clipfrac_lower)


@register_policy_loss("dppo_tv", settings=PPOClip)
def policy_loss_dppo_tv(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_ratio_c: float = loss_default("clip_ratio_c"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv:2602.04879): mask tokens whose probability moved too far, not whose ratio did.

    ``p = exp(log_prob)``, ``q = exp(old_log_prob)``; a token is kept when ``p - q <= clip_ratio_high``
    (A > 0) or ``p - q >= -clip_ratio_low`` (A <= 0): the clip settings are TOTAL-VARIATION thresholds
    here. ``L = -A * sg(min(r, clip_ratio_c)) * log_prob * keep`` with ``r = exp(clamp(log_prob -
    old_log_prob, ±20))``: a truncated-IS policy gradient (no dual-clip). ``clip_ratio_c`` defaults to
    the settings model's (verl's actor default, 3.0; verl's loss falls back to 20 only when the actor has
    none). Metrics: ``pg_clipfrac`` = masked share of dropped tokens, ``pg_clipfrac_lower`` = masked share
    of kept tokens whose ratio was truncated, ``ppo_kl`` = masked mean of the clamped ``-log r``.
    """
    diff = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, diff <= clip_ratio_high, diff >= -clip_ratio_low)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c, rollout_is_weights, agg)


@register_policy_loss("dppo_kl", settings=PPOClip)
def policy_loss_dppo_kl(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_ratio_c: float = loss_default("clip_ratio_c"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (arXiv:2602.04879): as ``dppo_tv`` with a binary KL divergence as the trust region.

    ``KL_b = q (log q - log p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))`` between the Bernoulli
    distributions "this token / any other" of the old (q) and current (p) policy. Kept where A > 0:
    ``KL_b <= clip_ratio_high or p <= q``; where A <= 0: ``KL_b <= clip_ratio_low or p >= q`` (a move
    against the advantage's direction is never dropped). Loss and metrics as ``dppo_tv``.
    """
    p, q = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = q * (old_log_prob - log_prob) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(
        advantages > 0, (binary_kl <= clip_ratio_high) | (p <= q), (binary_kl <= clip_ratio_low) | (p >= q)
    )
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c, rollout_is_weights, agg)


@register_policy_loss("gspo", settings=PPOClip)
def policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_ratio_c: float = loss_default("clip_ratio_c"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clipped surrogate on the sequence-level (length-normalised) importance ratio.

    ``log s_i = sum_t m_t (log_prob - old_log_prob) / max(1, sum_t m_t)`` (geometric mean of the token
    ratios over policy tokens). Per token the ratio is
    ``s_it = exp(min(10, sg(log s_i) + log_prob - sg(log_prob)))``: its value is ``s_i`` and its gradient
    is that of ``s_i * log_prob`` token by token. No ±20 clamp here; the log-ratio is clamped at +10 only.
    Loss per token ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``, no dual-clip.

    Aggregated with the given ``loss_agg_mode`` (verl 0.9.1; the GSPO paper's ``seq-mean-token-mean`` is
    the recommended setting, not forced). ``pg_clipfrac`` = masked share of clipped tokens,
    ``pg_clipfrac_lower`` = 0, ``ppo_kl`` = masked mean of ``old_log_prob - log_prob`` (unclamped).
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss1 = -advantages * seq_ratio
    loss2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(torch.maximum(loss1, loss2), rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **_global(agg))
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, _zero(loss))


@register_policy_loss("sapo", settings=SapoSettings, fixed_agg="seq-mean-token-mean")
def policy_loss_sapo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    tau_pos: float = loss_default("tau_pos"),
    tau_neg: float = loss_default("tau_neg"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (arXiv:2511.20347): a smooth sigmoid gate on the token ratio instead of a hard clip.

    ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``; ``tau = tau_pos`` where ``A > 0`` else
    ``tau_neg`` (verl defaults 1.0 and 1.05); per token ``L = -A * sigmoid(tau (r - 1)) * 4 / tau``
    (value ``-A`` times a gate equal to ``2 / tau`` at r = 1, whose slope there is 1 as PPO's). Aggregated
    with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (verl 0.9.1 does the same). Both clip
    fractions are 0; ``ppo_kl`` = masked mean of the clamped ``-log r``.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, mask, fixed_pg_agg("sapo"), **_global(agg))
    return loss, _metrics(_zero(loss), masked_mean(-log_ratio, mask), _zero(loss))


@register_policy_loss("gpg")
def policy_loss_gpg(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: plain policy gradient, ``L = -log_prob * A`` per token, no ratio and no clipping.

    Aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``. Both clip fractions are 0 (nothing is
    clipped); ``ppo_kl`` is still reported as the masked mean of ``old_log_prob - log_prob`` for
    monitoring (verl 0.9.1 returns no metrics for this loss).
    """
    mask = response_mask.to(log_prob.dtype)
    loss = agg_loss(_weighted(-log_prob * advantages, rollout_is_weights), mask, loss_agg_mode, **_global(agg))
    ppo_kl = masked_mean((old_log_prob - log_prob).detach(), mask)
    return loss, _metrics(_zero(loss), ppo_kl, _zero(loss))


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``(A - mean A) * (log_prob - mean log_prob)``, means over the policy tokens (detached)."""
    a, lp = advantages.detach(), log_prob.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov", settings=ClipCovSettings)
def policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_cov_ratio: float = loss_default("clip_cov_ratio"),
    clip_cov_lb: float = loss_default("clip_cov_lb"),
    clip_cov_ub: float = loss_default("clip_cov_ub"),
    generator: torch.Generator | None = None,
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    PPO's clipped surrogate (``r = exp(log_prob - old_log_prob)``, NO ±20 clamp, no dual-clip), where in
    addition a random few high-covariance tokens lose their gradient: among policy tokens that PPO did
    not clip and whose ``cov = (A - mean A)(log_prob - mean log_prob)`` (means over policy tokens) lies
    strictly inside ``(clip_cov_lb, clip_cov_ub)``, ``max(1, int(clip_cov_ratio * n_tokens))`` are picked
    uniformly at random (``torch.randperm`` with ``generator``) and their loss is multiplied by 0.
    ``clip_cov_ratio`` must be > 0. Metrics: ``pg_clipfrac`` = masked share of those zeroed tokens,
    ``ppo_kl`` = masked mean of ``-log r`` (verl reports no ``pg_clipfrac_lower``).
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    mask = response_mask.to(log_prob.dtype)
    live = mask > 0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_by_ppo = (loss2 > loss1) & live
    cov = _covariance(advantages, log_prob, mask)
    candidates = torch.nonzero(live & ~clipped_by_ppo & (cov > clip_cov_lb) & (cov < clip_cov_ub))
    n_pick = max(int(clip_cov_ratio * float(mask.sum())), 1)
    picked = candidates[torch.randperm(len(candidates), generator=generator)[:n_pick]]
    keep = torch.ones_like(mask)
    keep[picked[:, 0], picked[:, 1]] = 0.0
    pg_losses = _weighted(torch.maximum(loss1, loss2) * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **_global(agg))
    return loss, {"pg_clipfrac": masked_mean(1.0 - keep, mask).detach(), "ppo_kl": masked_mean(-log_ratio, mask).detach()}


@register_policy_loss("kl_cov", settings=KLCovSettings)
def policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    kl_cov_ratio: float = loss_default("kl_cov_ratio"),
    ppo_kl_coef: float = loss_default("ppo_kl_coef"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025): unclipped ratio surrogate plus a KL penalty on the top-covariance tokens.

    ``r = exp(log_prob - old_log_prob)`` (no clamp, no clipping); per token ``L = -A r``, and on the
    ``max(1, int(n_tokens * kl_cov_ratio))`` policy tokens with the LARGEST covariance
    ``(A - mean A)(log_prob - mean log_prob)`` (means over policy tokens; ``torch.topk``),
    ``L = -A r + ppo_kl_coef * |log r|`` (verl's config default 0.1). ``kl_cov_ratio`` must be > 0.
    Metric: ``ppo_kl`` = masked mean of ``|log r|`` (verl reports only this one).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    pg_losses = -advantages * torch.exp(log_ratio)
    live = torch.nonzero(mask.reshape(-1) > 0).flatten()
    if live.numel():
        cov = _covariance(advantages, log_prob, mask).reshape(-1)[live]
        top = live[torch.topk(cov, max(1, int(live.numel() * kl_cov_ratio))).indices]
        penalty = torch.zeros(mask.numel(), dtype=mask.dtype, device=mask.device)
        penalty[top] = 1.0
        pg_losses = pg_losses + ppo_kl_coef * abs_kl * penalty.reshape(mask.shape)
    loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **_global(agg))
    return loss, {"ppo_kl": masked_mean(abs_kl, mask).detach()}


@register_policy_loss("geo_mean", settings=ClipRange, fixed_agg="row-mean")
def policy_loss_geo_mean(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (arXiv:2507.20673): clip in log space per token, then the GEOMETRIC mean of the ratios.

    ``d = log_prob - old_log_prob`` (no ±20 clamp); ``d_c = clamp(d, -clip_ratio_low, clip_ratio_high)``
    (the clip bounds are on the LOG ratio); per token ``d* = sgn(A) * min(sgn(A) d, sgn(A) d_c)``. Per row
    ``rho_i = exp(sum_t m d* / (sum_t m + 1e-8))`` and the sequence advantage
    ``a_i = sum_t m A / (sum_t m + 1e-8)``; ``L = mean_i(-a_i rho_i)`` over ALL rows (empty rows count,
    with loss 0): ``loss_agg_mode`` is not used, as in verl. Rollout IS weights enter as their per-row
    geometric mean ``exp(sum_t m log(w + 1e-10) / (sum_t m + 1e-8))``. Metrics: ``pg_clipfrac`` /
    ``pg_clipfrac_lower`` = masked share of tokens whose ``d`` was clamped with A > 0 / A < 0,
    ``ppo_kl`` = masked mean of ``-d``.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    chosen = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    length = mask.sum(dim=-1) + 1e-8
    ratio = torch.exp(masked_sum(chosen, mask, dim=-1) / length)
    seq_adv = masked_sum(advantages, mask, dim=-1) / length
    pg_losses = -seq_adv * ratio
    if rollout_is_weights is not None:
        w = rollout_is_weights.detach()
        pg_losses = pg_losses * torch.exp(masked_sum(torch.log(w + 1e-10), mask, dim=-1) / length)
    # the mean over every row, empty ones included (verl's), over the whole mini-batch when ``agg`` is given
    rows = agg.rows if agg is not None else pg_losses.shape[0]
    loss = pg_losses.sum() / max(rows, 1) * (agg.dp_size if agg is not None else 1)
    was_clamped = torch.ne(log_ratio, clamped)
    pg_clipfrac = masked_mean((was_clamped & (advantages > 0)).to(mask.dtype), mask)
    pg_clipfrac_lower = masked_mean((was_clamped & (advantages < 0)).to(mask.dtype), mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, mask), pg_clipfrac_lower)


@register_policy_loss("dro", settings=DROSettings)
def policy_loss_dro(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dro_beta: float | None = None,
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Direct Reward Optimization): policy gradient with a quadratic log-ratio penalty.

    Per token ``L = -(log_prob * A - 0.5 * dro_beta * (log_prob - old_log_prob)^2)`` (no ratio, no clamp),
    times the rollout IS weights if given, then ``agg_loss``. ``dro_beta`` has no default and must be
    > 0 (ValueError otherwise, as in verl). Metric: ``ppo_kl`` = masked mean of ``old_log_prob - log_prob``.
    """
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"policy loss dro needs dro_beta > 0, got {dro_beta}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **_global(agg))
    return loss, {"ppo_kl": masked_mean(-log_ratio, mask).detach()}


@register_policy_loss("cispo", settings=ClipRange)
def policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): clip the importance weight, never the token.

    ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``; per token
    ``L = -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_prob``: the clipped ratio is a
    constant weight, so every token keeps the REINFORCE gradient ``-w A grad log_prob``.
    Aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``. ``pg_clipfrac`` = masked share of
    tokens whose ratio was clipped, ``pg_clipfrac_lower`` = 0, ``ppo_kl`` = masked mean of the clamped
    ``old_log_prob - log_prob``.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(-weight.detach() * advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **_global(agg))
    pg_clipfrac = masked_mean(torch.ne(ratio, weight).to(mask.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, _zero(loss))


def policy_loss_reinforce(
    rollout_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    *,
    rollout_is_weights: Tensor | None = None,
    agg: AggNorm | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain REINFORCE, the loss of verl's bypass mode with ``loss_type: reinforce``.

    Per token ``L = -A * log_prob``, or ``L = -A * log_prob * sg(w)`` with rollout IS weights ``w``
    (an IS-corrected policy gradient: no ratio in the objective, no clipping). ``agg_loss`` with the
    given mode. Metric ``ppo_kl`` = masked mean of ``rollout_log_prob - log_prob``.
    """
    mask = response_mask.to(log_prob.dtype)
    loss = agg_loss(_weighted(-advantages * log_prob, rollout_is_weights), mask, loss_agg_mode, **_global(agg))
    return loss, {"ppo_kl": masked_mean(rollout_log_prob - log_prob, mask).detach()}


@register_policy_loss("bypass_mode", settings=PPOClip)
def policy_loss_bypass_mode(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = loss_default("clip_ratio_low"),
    clip_ratio_high: float = loss_default("clip_ratio_high"),
    clip_ratio_c: float = loss_default("clip_ratio_c"),
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    agg: AggNorm | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's bypass mode: ``old_log_prob`` IS the rollout engine's log-prob (no recomputed old policy).

    The rollout-correction weights ``w`` are computed here, without gradient, from the CURRENT
    ``log_prob`` against the rollout's (``rollout_correction_weights`` with ``rollout_is``,
    ``rollout_is_threshold``, ``rollout_is_batch_normalize``; batch normalisation is over the tensors
    given, i.e. the micro-batch, as in verl). ``loss_type``:

    - ``reinforce``: ``policy_loss_reinforce`` with ``w`` (``rollout_is=None``: plain REINFORCE, no weights);
    - ``ppo_clip``: ``vanilla`` PPO with ratio ``pi / pi_rollout`` and NO extra weights (the ratio already
      is the importance weight; applying ``w`` too would count it twice).

    Metrics: the loss's own plus ``rollout_corr/...`` (weights and off-policy diagnostics).
    """
    with torch.no_grad():
        weights, corr = rollout_correction(
            log_prob.detach(),
            old_log_prob,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
    if loss_type == "reinforce":
        loss, metrics = policy_loss_reinforce(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights=weights, agg=agg
        )
    elif loss_type == "ppo_clip":
        loss, metrics = policy_loss_vanilla(
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            agg=agg,
        )
    else:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; valid: reinforce, ppo_clip")
    metrics.update({k: torch.as_tensor(v) for k, v in corr.items()})
    return loss, metrics


# ====================================================================== value loss
def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    agg: AggNorm | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss of PPO: ``0.5 * agg(max((v - R)^2, (v_clip - R)^2))``.

    ``v_clip = clamp(vpreds, values - cliprange_value, values + cliprange_value)`` with ``values`` the
    critic's predictions at rollout time; the pessimistic max is taken per token, then ``agg_loss``.
    Returns ``(vf_loss, vf_clipfrac)``, the latter the masked share of tokens where the clipped error
    is strictly larger.
    """
    mask = response_mask.to(vpreds.dtype)
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    err1 = (vpreds - returns) ** 2
    err2 = (clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(err1, err2), mask, loss_agg_mode, **_global(agg))
    vf_clipfrac = masked_mean(torch.gt(err2, err1).to(mask.dtype), mask)
    return vf_loss, vf_clipfrac.detach()
