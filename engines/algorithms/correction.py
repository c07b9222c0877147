"""Rollout correction: importance weights of the trainer's policy against the rollout's, and off-policy metrics."""

from __future__ import annotations

import math

import torch

from rlstage.engines.algorithms.masked import masked_mean, masked_sum
from rlstage.schemas.config import parse_is_threshold

Tensor = torch.Tensor


# ====================================================================== rollout correction
ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
SAFETY_BOUND = 20.0  # |log weight| is clamped here before exp (exp(20) ~ 4.9e8)


def rollout_correction(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = "token",
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Tensor | None, dict[str, float]]:
    """Rollout-correction importance weights ``pi_train / pi_rollout`` (verl's ``rollout_corr`` helper).

    ``log_ratio = log_prob - rollout_log_prob`` (``log_prob``: the trainer's old log-probs in decoupled
    mode, the current ones in bypass mode).

    - ``rollout_is="token"``: ``w_t = exp(clamp(log_ratio_t, ±20))``;
      ``"sequence"``: ``w_i = exp(clamp(sum_t m log_ratio_t, ±20))`` broadcast over the row; None: no
      weights (metrics only). Weights are 0 on masked tokens.
    - ``rollout_is_threshold``: a number U truncates (TIS) ``w <- min(w, U)``; ``"L_U"`` (IcePop) zeroes
      every weight outside ``[L, U]`` and keeps the others unchanged.
    - ``rollout_is_batch_normalize``: divide by the mean weight (over policy tokens for ``token``, over
      non-empty rows for ``sequence``) when that mean is > 1e-8.

    Returns detached weights and ``rollout_corr/...`` metrics: ``rollout_is_mean/max/min/std``,
    ``rollout_is_ratio_fraction_high/low`` (raw weights above U / below L, L = 1/U for TIS),
    ``rollout_is_eff_sample_size``, ``rollout_is_seq_mean/std/max/min/max_deviation/fraction_high/low``,
    ``rollout_is_oob_ratio`` (IcePop), ``rollout_is_batch_norm_factor``, and the off-policy diagnostics of
    ``offpolicy_metrics``. An empty mask gives no weights' metrics and zero diagnostics.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - rollout_log_prob
    metrics = {f"rollout_corr/{k}": v for k, v in offpolicy_metrics(log_prob, rollout_log_prob, mask).items()}
    if rollout_is is None:
        return None, metrics
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; valid: {', '.join(ROLLOUT_IS_LEVELS)}")
    lower, upper = parse_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_w = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    else:
        log_w = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    raw = torch.exp(torch.clamp(log_w, -SAFETY_BOUND, SAFETY_BOUND)) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if not mask.any():
        return weights.detach(), metrics
    low_bound = 1.0 / upper if lower is None else lower
    m = {
        "rollout_is_mean": float(masked_mean(weights, mask)),
        "rollout_is_max": float(weights[mask.bool()].max()),
        "rollout_is_min": float(weights[mask.bool()].min()),
        "rollout_is_ratio_fraction_high": float(masked_mean((raw > upper).to(mask.dtype), mask)),
        "rollout_is_ratio_fraction_low": float(masked_mean((raw < low_bound).to(mask.dtype), mask)),
    }
    if rollout_is == "sequence":  # per row, from the unclamped row log-ratio (every row counts, as in verl)
        row_log = masked_sum(log_ratio, mask, dim=-1)
        m["rollout_is_max"] = math.exp(min(float(row_log.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(row_log.min()))
        m["rollout_is_ratio_fraction_high"] = float((row_log > math.log(upper)).double().mean())
        m["rollout_is_ratio_fraction_low"] = float((row_log < math.log(low_bound)).double().mean())
    capped = weights.clamp(min=0.0, max=upper)
    mean_c = masked_mean(capped, mask)
    var = masked_mean(capped.square(), mask) - mean_c.square()
    m["rollout_is_std"] = float(torch.sqrt(var.clamp(min=0.0))) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = float(1.0 / masked_mean((capped / (mean_c + 1e-8)).square(), mask))
    seq_w = masked_mean(weights, mask, dim=-1)
    raw_seq = masked_mean(raw, mask, dim=-1)
    m.update(
        {
            "rollout_is_seq_mean": float(seq_w.mean()),
            "rollout_is_seq_std": float(seq_w.std()) if seq_w.numel() > 1 else 0.0,
            "rollout_is_seq_max": float(seq_w.max()),
            "rollout_is_seq_min": float(seq_w.min()),
            "rollout_is_seq_max_deviation": float((seq_w - 1.0).abs().max()),
            "rollout_is_seq_fraction_high": float((raw_seq > upper).double().mean()),
            "rollout_is_seq_fraction_low": float((raw_seq < low_bound).double().mean()),
        }
    )
    if lower is not None:
        m["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).to(mask.dtype), mask))
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            rows = (mask.sum(dim=-1) > 0).to(mask.dtype)
            mean = (seq_w * rows).sum() / rows.sum().clamp(min=1e-8)
        factor = float(mean) if mean > 1e-8 else 1.0
        weights = weights / factor
        m["rollout_is_batch_norm_factor"] = factor
    metrics.update({f"rollout_corr/{k}": v for k, v in m.items()})
    return weights.detach(), metrics


def offpolicy_metrics(log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Train/inference mismatch diagnostics (verl's off-policy metrics; per-row means over policy tokens).

    ``training_ppl`` / ``rollout_ppl`` = batch mean of ``exp(-row mean log-prob)``, ``*_log_ppl`` their
    logs' means, ``kl`` = masked mean of ``rollout - train``, ``k3_kl`` = masked mean of
    ``exp(d) - d - 1`` with ``d = train - rollout``, ``log_ppl_diff`` (mean, ``abs_diff``, ``max``,
    ``min``) of ``row mean rollout - row mean train``, ``ppl_ratio`` = mean of its exp,
    ``chi2_token`` = masked mean of ``exp(2 clamp(d, ±20))`` - 1, ``chi2_seq`` = batch mean of
    ``exp(2 clamp(sum_t m d, ±20))`` - 1. All 0 when the mask is empty.
    """
    mask = response_mask.to(log_prob.dtype)
    names = (
        "training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
        "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
    )  # fmt: skip
    if not mask.any():
        return dict.fromkeys(names, 0.0)
    d = torch.where(mask.bool(), log_prob - rollout_log_prob, torch.zeros_like(log_prob))
    train_row = masked_mean(log_prob, mask, dim=-1)
    roll_row = masked_mean(rollout_log_prob, mask, dim=-1)
    diff = roll_row - train_row
    seq_d = torch.clamp(masked_sum(d, mask, dim=-1), -SAFETY_BOUND, SAFETY_BOUND)
    values = (
        torch.exp(-train_row).mean(), (-train_row).mean(), masked_mean(-d, mask),
        masked_mean(torch.exp(d) - d - 1, mask), torch.exp(-roll_row).mean(), (-roll_row).mean(), diff.mean(),
        diff.abs().mean(), diff.max(), diff.min(), torch.exp(diff).mean(),
        masked_mean(torch.exp(2 * torch.clamp(d, -SAFETY_BOUND, SAFETY_BOUND)), mask) - 1.0,
        torch.exp(2 * seq_d).mean() - 1.0,
    )  # fmt: skip
    return {k: float(v) for k, v in zip(names, values, strict=True)}
