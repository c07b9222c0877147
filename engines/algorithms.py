"""The RL math of rlstage: advantage estimators, policy losses, loss aggregation, KL terms, rollout
correction and DAPO's overlong reward shaping.

Pure torch (plus numpy-compatible group ids), no Prefect, no Ray. Everything that a config picks
by name lives in a registry (``ADV_ESTIMATORS``, ``POLICY_LOSSES``) or a name tuple
(``LOSS_AGG_MODES``, ``KL_TYPES``), and the conventions follow verl 0.9.1
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

import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from rlstage.schemas.config import parse_is_threshold

Tensor = torch.Tensor
GroupIndex = Sequence[Hashable] | np.ndarray
AdvEstimatorFn = Callable[..., tuple[Tensor, Tensor]]
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

__all__ = [
    "ADV_ESTIMATORS",
    "FIXED_PG_AGG",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "offpolicy_metrics",
    "overlong_penalty",
    "policy_loss_reinforce",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_correction",
]


# ====================================================================== masked helpers
def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x * mask``, reduced over ``dim`` (all elements when None).

    Positions where the mask is 0 are replaced by 0 *before* multiplying, so a NaN or inf sitting in a
    masked-out slot (padding, a tool-output token) never reaches the result (verl does the same).
    """
    valid = torch.where(mask.bool(), x, torch.zeros_like(x))
    prod = valid * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Token-weighted mean: ``masked_sum(x, mask, dim) / (mask.sum(dim) + 1e-8)``.

    The 1e-8 in the denominator is verl's: an all-zero mask gives 0, not NaN.
    """
    denom = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / (denom + 1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Token-weighted variance over every selected element of the batch (one scalar).

    ``var = masked_mean((x - masked_mean(x))**2)``, times the Bessel factor ``n / (n - 1)`` when
    ``unbiased`` (n = number of selected tokens). As in verl, the unbiased form raises ValueError when
    fewer than two tokens are selected instead of returning inf/NaN.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element")
        if n == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance is undefined")
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Batch whitening with token-weighted statistics: ``(x - mean) * rsqrt(var + 1e-8)``.

    ``mean`` is ``masked_mean`` and ``var`` the *unbiased* ``masked_var`` over all selected tokens of the
    whole batch; eps 1e-8 sits under the rsqrt. With ``shift_mean=False`` the mean is added back (scale
    only). The result is NOT multiplied by the mask: positions outside it are transformed too, callers
    multiply when they want zeros there.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last axis: ``logsumexp(z) - sum(softmax(z) * z)``."""
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def _safe_den(d: Tensor) -> Tensor:
    # An all-empty batch divides 0 by 1 instead of 0 by 0 (finite value and finite gradient).
    return torch.where(d > 0, d, torch.ones_like(d))


# ====================================================================== group statistics
def _group_ids(index: GroupIndex, n: int) -> tuple[Tensor, int]:
    """Dense group numbers (first-appearance order) for any hashable ids."""
    if len(index) != n:
        raise ValueError(f"index has {len(index)} entries but the batch has {n} rows")
    ids: dict[Hashable, int] = {}
    inv = [ids.setdefault(k.item() if isinstance(k, np.generic) else k, len(ids)) for k in index]
    return torch.tensor(inv, dtype=torch.long), len(ids)


def _group_sum(x: Tensor, inv: Tensor) -> Tensor:
    """Per-row sum of ``x`` over the row's group."""
    g = int(inv.max().item()) + 1 if inv.numel() else 0
    return torch.zeros(g, dtype=x.dtype, device=x.device).index_add(0, inv, x)[inv]


def _group_stats(scores: Tensor, index: GroupIndex) -> dict[str, Tensor]:
    """Per-row count, sum, mean and unbiased std of the row's group, in float64.

    float64 keeps a constant group's deviations exactly 0 (float32 sums can leave 1e-8 residues that a
    1e-6 eps would then blow up). Rows of a one-member group get mean 0 and std 1, verl's convention.
    """
    s = scores.detach().to(torch.float64)
    inv, g = _group_ids(index, s.shape[0])
    inv = inv.to(s.device)
    zeros = torch.zeros(g, dtype=torch.float64, device=s.device)
    count = zeros.index_add(0, inv, torch.ones_like(s))
    total = zeros.index_add(0, inv, s)
    mean = total / count
    sq = zeros.index_add(0, inv, (s - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return {"inv": inv, "count": count[inv], "total": total[inv], "mean": mean[inv], "std": std[inv]}


# ====================================================================== advantage estimators
ADV_ESTIMATORS: dict[str, AdvEstimatorFn] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register an advantage estimator under ``name``.

    An estimator is called with keyword arguments only, taking the subset of
    ``token_level_rewards, response_mask, index, values, reward_baselines, gamma, lam,
    norm_adv_by_std_in_grpo, epsilon, old_log_probs, sum_pi_squared, rollout_is_weights`` that its
    signature names; parameters without a default are required. It returns ``(advantages, returns)``,
    both ``[batch, response_len]``.
    """

    def deco(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The registered estimator called ``name``; ValueError naming the valid ones otherwise."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def _float_mask(response_mask: Tensor, like: Tensor) -> Tensor:
    return response_mask.to(dtype=like.dtype, device=like.device)


@register_adv_estimator("gae")
@torch.no_grad()
def gae_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation with a critic (PPO).

    Backwards over t, with ``m_t`` the mask::

        delta_t   = r_t + gamma * V_next - V_t
        A_cand    = delta_t + gamma * lam * A_next
        V_next    <- m_t * V_t    + (1 - m_t) * V_next
        A_next    <- m_t * A_cand + (1 - m_t) * A_next
        A_t       = A_next

    Masked positions (padding or tool/observation tokens in a gap) neither read nor overwrite the
    carried next-value / running advantage, so the recursion jumps over a gap: the value after the
    gap is discounted once, as if the gap tokens were not there, and values at masked positions have
    no effect on any advantage. A masked position reports the advantage carried from the right.

    ``returns = A + V`` is taken BEFORE whitening (and includes ``V_t`` at masked positions); then
    ``A`` is whitened with ``masked_whiten`` (batch-wide token-weighted mean, unbiased variance,
    eps 1e-8 under the rsqrt) and is not multiplied by the mask afterwards.
    """
    mask = _float_mask(response_mask, values)
    rewards = token_level_rewards.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        cand = delta + gamma * lam * running
        next_value = m * values[:, t] + (1 - m) * next_value
        running = m * cand + (1 - m) * running
        out[:, t] = running
    returns = out + values
    return masked_whiten(out, mask), returns


@register_adv_estimator("grpo_vectorized")
@register_adv_estimator("grpo")
@torch.no_grad()
def grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage, one scalar per response broadcast over its tokens.

    ``s_i = sum_t token_level_rewards[i, t]`` (the whole row, mask not applied). Within the group of
    ``i``: ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with ``std_g`` the UNBIASED sample std
    (``torch.std``, n - 1) and ``epsilon = 1e-6`` added to the std (not under a root). A one-member
    group uses mean 0 and std 1, so its advantage is ``s_i / (1 + eps)``, not 0. A constant group gets 0.
    ``norm_adv_by_std_in_grpo=False`` is Dr. GRPO: ``A_i = s_i - mean_g``.
    Output ``A_i * response_mask`` (0 on padding and in gaps); returns equal advantages.
    Also registered as ``grpo_vectorized``: verl's vectorised GRPO computes the same values (its variance
    floor is 0 there), which this implementation already is.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    centred = scores.to(torch.float64) - st["mean"]
    adv = centred / (st["std"] + epsilon) if norm_adv_by_std_in_grpo else centred
    out = adv.to(scores.dtype).unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """RLOO (REINFORCE leave-one-out) outcome advantage.

    For a group of size ``n > 1``: ``A_i = s_i - mean(s_j, j != i) = (n * s_i - sum_g) / (n - 1)``.
    A one-member group keeps its raw score, ``A_i = s_i`` (verl's loop ``rloo`` leaves it untouched;
    ``rloo_vectorized`` gives it 0). No std, no eps. Output ``A_i * response_mask``; returns equal
    advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    s, n = scores.to(torch.float64), st["count"]
    loo = (n * s - st["total"]) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, loo, s)
    out = adv.to(scores.dtype).unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("rloo_vectorized")
@torch.no_grad()
def rloo_vectorized_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """verl's ``rloo_vectorized``: ``rloo`` except that a one-member group gets advantage 0.

    ``A_i = (n * s_i - sum_g) / max(1, n - 1)`` where ``n > 1``, else 0 (no other sample to compare with).
    Output ``A_i * response_mask``; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    s, n = scores.to(torch.float64), st["count"]
    adv = torch.where(n > 1, (n * s - st["total"]) / (n - 1).clamp(min=1), torch.zeros_like(s))
    out = adv.to(scores.dtype).unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch.

    Backwards over t, with ``m_t`` the mask::

        G_cand    = r_t + gamma * G
        returns_t = G_cand * m_t
        G        <- m_t * G_cand + (1 - m_t) * G

    A masked position (padding, a tool-output gap) neither adds its reward nor discounts: the running
    return is carried across it unchanged (as GAE carries its next value), so tokens before a tool turn
    see the reward placed after it, discounted once per POLICY token. ``returns`` is 0 on masked tokens.
    Advantages are ``masked_whiten(returns) * response_mask`` (token-weighted mean, unbiased variance,
    eps 1e-8 under the rsqrt). verl 0.9.1 ``reinforce_plus_plus``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        cand = token_level_rewards[:, t] + gamma * running
        returns[:, t] = cand * m
        running = m * cand + (1 - m) * running
    return masked_whiten(returns, mask) * mask, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline.

    ``a_i = s_i - mean_g`` (one-member group: mean 0, so ``a_i = s_i``), broadcast over tokens times
    the mask, then whitened over the whole batch with ``masked_whiten`` and multiplied by the mask again.
    The whitening statistics are TOKEN-weighted (a long response counts once per token), with the
    unbiased variance and eps 1e-8 under the rsqrt. Returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    mask = _float_mask(response_mask, scores)
    st = _group_stats(scores, index)
    centred = (scores.to(torch.float64) - st["mean"]).to(scores.dtype)
    tiled = centred.unsqueeze(-1) * mask
    out = masked_whiten(tiled, mask) * mask
    return out, out


@register_adv_estimator("remax")
@torch.no_grad()
def remax_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the greedy-decoding baseline of the same prompt.

    ``returns_t = sum_{k >= t} r_k * m_k`` (undiscounted, masked rewards only, no reset at gaps);
    ``A_t = returns_t - b * m_t`` where ``b = reward_baselines[i]`` is the score of the greedy response.
    No whitening; ``A`` is not multiplied by the mask beyond the baseline term.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    base = reward_baselines.to(returns.dtype).reshape(-1, 1)
    return returns - base * mask, returns


@register_adv_estimator("opo")
@torch.no_grad()
def opo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """OPO: outcome advantage against a length-weighted group baseline.

    ``L_i = sum_t response_mask[i, t]`` (policy tokens only, gaps excluded);
    ``b_g = sum_j L_j s_j / sum_j L_j`` over the group; ``A_i = s_i - b_g``. A one-member group uses
    ``b = 0``. A group whose responses are all empty would divide 0 by 0 (NaN in verl); here its
    baseline is 0. Output ``A_i * response_mask``; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    mask = _float_mask(response_mask, scores)
    lengths = mask.sum(dim=-1).to(torch.float64)
    st = _group_stats(scores, index)
    num = _group_sum(lengths * scores.to(torch.float64), st["inv"])
    den = _group_sum(lengths, st["inv"])
    base = torch.where((st["count"] > 1) & (den > 0), num / _safe_den(den), torch.zeros_like(num))
    adv = (scores.to(torch.float64) - base).to(scores.dtype)
    out = adv.unsqueeze(-1) * mask
    return out, out


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """GPG (Group Policy Gradient) outcome advantage.

    ``alpha = B / max(1, #{i : s_i != 0})`` over the whole batch of ``B`` rows;
    ``A_i = alpha * (s_i - mean_g)`` with no std normalisation (verl computes a group std but does not
    use it; f_norm = 1). A one-member group uses mean 0, so ``A_i = alpha * s_i``.
    Output ``A_i * response_mask``; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    alpha = scores.shape[0] / max(1, int(torch.count_nonzero(scores).item()))
    adv = (alpha * (scores.to(torch.float64) - st["mean"])).to(scores.dtype)
    out = adv.unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def grpo_passk_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO (Chen et al. 2025, arXiv:2503.19595): only the best response of a group learns.

    Per group: ``A = s_max - s_second`` for the row holding the group's maximum (the first such row when
    several tie; a tie gives 0 anyway), 0 for every other row; divided by ``std_g + epsilon`` (unbiased
    std of the group's scores) when ``norm_adv_by_std_in_grpo``. A group with fewer than two samples is
    a ValueError, as in verl. Output ``A_i * response_mask``; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    if bool((st["count"] < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group (rollout.n >= 2)")
    s = scores.detach().to(torch.float64)
    adv = torch.zeros_like(s)
    inv = st["inv"]
    for g in range(int(inv.max().item()) + 1 if inv.numel() else 0):
        rows = (inv == g).nonzero().flatten()
        vals = s[rows]
        top = torch.topk(vals, 2).values
        best = rows[int(torch.argmax(vals))]  # argmax returns the first maximum
        a = top[0] - top[1]
        adv[best] = a / (st["std"][best] + epsilon) if norm_adv_by_std_in_grpo else a
    out = adv.to(scores.dtype).unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("gdpo")
@torch.no_grad()
def gdpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """GDPO (arXiv:2601.05242) with a single reward dimension.

    GDPO normalises each reward dimension with GRPO inside its group, sums them (weighted), then whitens
    the sum over the batch. With one dimension: ``A = masked_whiten(grpo(r) , m) * m``, i.e. the GRPO
    advantage (eps 1e-6 on the std, one-member group mean 0 / std 1) whitened over all policy tokens of the
    batch (token-weighted mean, unbiased variance, eps 1e-8 under the rsqrt). Returns equal advantages.
    """
    grpo, _ = grpo_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    mask = _float_mask(response_mask, grpo)
    out = masked_whiten(grpo, mask) * mask
    return out, out


def _otb_step_weights(
    old_log_probs: Tensor, sum_pi_squared: Tensor, response_mask: Tensor, rollout_is_weights: Tensor | None
) -> Tensor:
    """``W_t = sum_{j <= t} m_j (1 - 2 pi_j + sum_v pi_v^2) (rho_j^2)``: the path-variance proxy of OTB."""
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    return (w * response_mask).cumsum(dim=-1)


def _zero_tail(baselines: Tensor, lengths: Tensor, rows: list[int]) -> None:
    """Zero the baseline where the group's single longest response runs past the second longest."""
    ls = lengths[rows]
    ordered = torch.sort(ls).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_max = (ls == longest).nonzero().flatten()
    if at_max.numel() == 1 and longest > second:
        baselines[rows[int(at_max[0])], second:] = 0.0


@register_adv_estimator("optimal_token_baseline")
@torch.no_grad()
def optimal_token_baseline_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Optimal Token Baseline (verl ``optimal_token_baseline``): a per-position baseline per group.

    ``G_t = sum_{k >= t} r_k m_k`` (undiscounted return-to-go over policy tokens);
    ``w_t = 1 - 2 pi_t + sum_pi_squared_t`` with ``pi_t = exp(old_log_probs_t)`` (times ``rho_t^2`` with
    rollout IS weights), ``W_t = cumsum_t(w_t m_t)``. At each COLUMN t of a group with n > 1 members:
    ``B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + 1e-8)``; a one-member group has ``B = 0``. With
    ``handle_zero_tail`` the group's unique longest response gets ``B = 0`` from the second-longest
    length on (columns where no other member is left to compare). ``A = (G - B) * m``; returns are ``G``
    (not masked beyond the rewards). Positions are columns, so with gaps a column of one row may be
    compared with a different turn of another row: the TIR variant aligns policy tokens instead.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_cum = _otb_step_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    baselines = torch.zeros_like(returns)
    inv, g = _group_ids(index, returns.shape[0])
    lengths = mask.sum(dim=-1)
    for k in range(g):
        rows = (inv == k).nonzero().flatten().tolist()
        if len(rows) == 1:
            continue
        num = (returns[rows] * w_cum[rows] * mask[rows]).sum(dim=0)
        den = (w_cum[rows] * mask[rows]).sum(dim=0) + 1e-8
        baselines[rows] = (num / den).unsqueeze(0).expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, lengths, rows)
    return (returns - baselines) * mask, returns


@register_adv_estimator("tir_optimal_token_baseline")
@torch.no_grad()
def tir_optimal_token_baseline_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    old_log_probs: Tensor,
    sum_pi_squared: Tensor,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Multi-turn (tool-integrated) OTB, verl ``tir_optimal_token_baseline``.

    As ``optimal_token_baseline``, but each response's POLICY tokens are first packed to the left
    (tool-output gaps removed), so the baseline at step k compares the k-th policy token of every member
    of the group, whatever turn it sits in. ``G`` and ``W`` are computed on the gapped row (a gap neither
    adds reward nor weight), gathered at policy positions, the baseline taken over packed steps, and the
    advantage scattered back to the policy positions (0 elsewhere). Rows without policy tokens are left
    out of their group. Returns are the gapped ``G``.
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_cum = _otb_step_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    lengths = mask.sum(dim=-1).long()
    width = int(lengths.max()) if lengths.numel() else 0
    packed_w = returns.new_zeros((returns.shape[0], width))
    packed_g = torch.zeros_like(packed_w)
    for i in range(returns.shape[0]):
        sel = mask[i].bool()
        packed_w[i, : int(lengths[i])] = w_cum[i, sel]
        packed_g[i, : int(lengths[i])] = returns[i, sel]
    inv, g = _group_ids(index, returns.shape[0])
    baselines = torch.zeros_like(packed_g)
    for k in range(g):
        rows = [r for r in (inv == k).nonzero().flatten().tolist() if lengths[r] > 0]
        if len(rows) < 2:
            continue
        b = (packed_g[rows] * packed_w[rows]).sum(dim=0) / (packed_w[rows].sum(dim=0) + 1e-8)
        baselines[rows] = b.to(baselines.dtype).unsqueeze(0).expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, lengths, rows)
    packed_adv = packed_g - baselines
    adv = torch.zeros_like(returns)
    for i in range(returns.shape[0]):
        adv[i, mask[i].bool()] = packed_adv[i, : int(lengths[i])]
    return adv * mask, returns


def compute_advantage(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the estimator ``name`` and return ``(advantages, returns)``.

    Each estimator receives only the arguments its signature names; a required one (no default) that
    is None here raises ValueError (``gae`` needs ``values``, ``remax`` ``reward_baselines``, the group
    estimators ``index``).
    """
    fn = get_adv_estimator(name)
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} differ in shape"
        )
    available: dict[str, Any] = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "index": index,
        "values": values,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "epsilon": epsilon,
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
        "rollout_is_weights": rollout_is_weights,
    }
    kwargs: dict[str, Any] = {}
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        value = available.get(pname)
        if value is None:
            if p.default is p.empty:
                raise ValueError(f"advantage estimator {name!r} needs {pname!r}")
            continue
        kwargs[pname] = value
    return fn(**kwargs)


# ====================================================================== reward shaping
def overlong_penalty(lengths: Sequence[int], max_response: int, buffer_len: int, penalty_factor: float) -> list[float]:
    """DAPO's soft overlong punishment, added to each response's score (verl's DAPO reward manager).

    ``excess = length - (max_response - buffer_len)``; ``penalty = min(0, -excess / buffer_len *
    penalty_factor)``: 0 up to ``max_response - buffer_len`` tokens, then linear down to ``-penalty_factor``
    at the length limit. ``buffer_len`` must be in ``(0, max_response]``.
    """
    if not 0 < buffer_len <= max_response:
        raise ValueError(f"overlong buffer length {buffer_len} must be in (0, {max_response}]")
    expected = max_response - buffer_len
    return [min(-(n - expected) / buffer_len * penalty_factor, 0.0) for n in lengths]


# ====================================================================== loss aggregation
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)  # fmt: skip


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce a ``[batch, len]`` loss matrix to a scalar (verl 0.9.1 ``agg_loss``).

    - ``token-mean``: ``sum(L * m) / N_tok * dp_size``; every policy token weighs the same.
    - ``token-sum``: ``sum(L * m) * dp_size`` (no normalisation at all).
    - ``seq-mean-token-sum``: per row ``sum_t L * m``, summed over NON-EMPTY rows, ``/ N_seq * dp_size``.
    - ``seq-mean-token-mean``: per row ``sum_t L * m / (sum_t m + 1e-8)``, summed over non-empty rows,
      ``/ N_seq * dp_size``.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by ``loss_scale_factor`` (default: the
      padded width ``loss_mask.shape[-1]``), the constant normaliser of Dr. GRPO.

    Data-parallel global normalisation: a rank that holds only its shard of a mini-batch passes the
    mini-batch's GLOBAL policy-token count ``batch_num_tokens`` (token-mean) or non-empty-row count
    ``global_batch_size`` (seq-mean modes) and the number of ranks ``dp_size``. Data-parallel training
    AVERAGES the ranks' gradients, so the ``* dp_size`` makes the averaged gradient that of the whole
    mini-batch on one rank. Without global counts the local ones are used (``dp_size`` must then be 1,
    as verl requires). Rows whose mask is all zero are excluded from the sequence count. Masked-out
    entries are dropped even if they hold NaN/inf. An empty batch gives 0 with a finite gradient (verl
    would divide 0 by 0).
    """
    mask = loss_mask.to(dtype=loss_mat.dtype, device=loss_mat.device)
    if dp_size > 1 and loss_agg_mode != "token-sum":
        needed = batch_num_tokens if loss_agg_mode == "token-mean" else global_batch_size
        if needed is None:
            key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
            raise ValueError(f"agg_loss: dp_size={dp_size} needs the global {key} of the mini-batch")
    if loss_agg_mode == "token-mean":
        den = mask.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=loss_mat.dtype)
        return masked_sum(loss_mat, mask) / _safe_den(den) * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    tokens = mask.sum(dim=-1)
    seq_mask = (tokens > 0).to(loss_mat.dtype)
    seqs = seq_mask.sum() if global_batch_size is None else torch.as_tensor(global_batch_size, dtype=loss_mat.dtype)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
        loss = masked_sum(seq_losses, seq_mask) / _safe_den(seqs) * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_sum(loss_mat, mask, dim=-1) / (tokens + 1e-8)
        return masked_sum(seq_losses, seq_mask) / _safe_den(seqs) * dp_size
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


# ====================================================================== policy losses
POLICY_LOSSES: dict[str, PolicyLossFn] = {}

# Losses whose aggregation does not follow loss_agg_mode (see their docstrings): what they use instead.
# "row-mean" is a plain mean over all rows of the batch, empty ones included.
FIXED_PG_AGG: dict[str, str] = {"sapo": "seq-mean-token-mean", "geo_mean": "row-mean"}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name``.

    Signature: ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, rollout_is_weights=None, **kw) ->
    (loss, metrics)``; the loss-specific settings (``tau_pos``, ``clip_cov_ratio``, ``dro_beta``, ...)
    come as keywords named as in the actor config and are ignored by losses that do not use them.
    ``rollout_is_weights`` (detached, ``[batch, len]``) multiply the per-token losses before aggregation.
    Metrics are detached scalars, named as verl names them without the ``actor/`` prefix (keys holding a
    ``/`` are logged as they are, e.g. ``rollout_corr/...``).
    """

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered policy loss called ``name``; ValueError naming the valid ones otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


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


@register_policy_loss("vanilla")
def policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """The shared part of DPPO: truncated-IS policy gradient on the tokens ``valid`` keeps."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    keep = valid.detach().to(mask.dtype)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    pg_losses = _weighted(-advantages * truncated * log_prob * keep, rollout_is_weights)
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    pg_clipfrac = masked_mean(1.0 - keep, mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(mask.dtype) * keep, mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, mask), pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def policy_loss_dppo_tv(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: Tensor | None = None,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv:2602.04879): mask tokens whose probability moved too far, not whose ratio did.

    ``p = exp(log_prob)``, ``q = exp(old_log_prob)``; a token is kept when ``p - q <= clip_ratio_high``
    (A > 0) or ``p - q >= -clip_ratio_low`` (A <= 0): the clip settings are TOTAL-VARIATION thresholds
    here. ``L = -A * sg(min(r, clip_ratio_c)) * log_prob * keep`` with ``r = exp(clamp(log_prob -
    old_log_prob, ±20))``: a truncated-IS policy gradient (no dual-clip). verl falls back to
    ``clip_ratio_c = 20`` but reads the actor's ``clip_ratio_c`` (default 3) when set, as the actor does
    here. Metrics: ``pg_clipfrac`` = masked share of dropped tokens, ``pg_clipfrac_lower`` = masked share
    of kept tokens whose ratio was truncated, ``ppo_kl`` = masked mean of the clamped ``-log r``.
    """
    diff = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, diff <= clip_ratio_high, diff >= -clip_ratio_low)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c, rollout_is_weights)


@register_policy_loss("dppo_kl")
def policy_loss_dppo_kl(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    rollout_is_weights: Tensor | None = None,
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
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, valid, clip_ratio_c, rollout_is_weights)


@register_policy_loss("gspo")
def policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, _zero(loss))


@register_policy_loss("sapo")
def policy_loss_sapo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(pg_losses, mask, FIXED_PG_AGG["sapo"])
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
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: plain policy gradient, ``L = -log_prob * A`` per token, no ratio and no clipping.

    Aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``. Both clip fractions are 0 (nothing is
    clipped); ``ppo_kl`` is still reported as the masked mean of ``old_log_prob - log_prob`` for
    monitoring (verl 0.9.1 returns no metrics for this loss).
    """
    mask = response_mask.to(log_prob.dtype)
    loss = agg_loss(_weighted(-log_prob * advantages, rollout_is_weights), mask, loss_agg_mode)
    ppo_kl = masked_mean((old_log_prob - log_prob).detach(), mask)
    return loss, _metrics(_zero(loss), ppo_kl, _zero(loss))


def _covariance(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``(A - mean A) * (log_prob - mean log_prob)``, means over the policy tokens (detached)."""
    a, lp = advantages.detach(), log_prob.detach()
    return (a - masked_mean(a, mask)) * (lp - masked_mean(lp, mask))


@register_policy_loss("clip_cov")
def policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    return loss, {"pg_clipfrac": masked_mean(1.0 - keep, mask).detach(), "ppo_kl": masked_mean(-log_ratio, mask).detach()}


@register_policy_loss("kl_cov")
def policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(abs_kl, mask).detach()}


@register_policy_loss("geo_mean")
def policy_loss_geo_mean(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: Tensor | None = None,
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
    loss = pg_losses.mean()
    was_clamped = torch.ne(log_ratio, clamped)
    pg_clipfrac = masked_mean((was_clamped & (advantages > 0)).to(mask.dtype), mask)
    pg_clipfrac_lower = masked_mean((was_clamped & (advantages < 0)).to(mask.dtype), mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, mask), pg_clipfrac_lower)


@register_policy_loss("dro")
def policy_loss_dro(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dro_beta: float | None = None,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(-log_ratio, mask).detach()}


@register_policy_loss("cispo")
def policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: Tensor | None = None,
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
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain REINFORCE, the loss of verl's bypass mode with ``loss_type: reinforce``.

    Per token ``L = -A * log_prob``, or ``L = -A * log_prob * sg(w)`` with rollout IS weights ``w``
    (an IS-corrected policy gradient: no ratio in the objective, no clipping). ``agg_loss`` with the
    given mode. Metric ``ppo_kl`` = masked mean of ``rollout_log_prob - log_prob``.
    """
    mask = response_mask.to(log_prob.dtype)
    loss = agg_loss(_weighted(-advantages * log_prob, rollout_is_weights), mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(rollout_log_prob - log_prob, mask).detach()}


@register_policy_loss("bypass_mode")
def policy_loss_bypass_mode(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
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
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights=weights
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
        )
    else:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; valid: reinforce, ppo_clip")
    metrics.update({k: torch.as_tensor(v) for k, v in corr.items()})
    return loss, metrics


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


# ====================================================================== value loss
def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
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
    vf_loss = 0.5 * agg_loss(torch.max(err1, err2), mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(err2, err1).to(mask.dtype), mask)
    return vf_loss, vf_clipfrac.detach()


# ====================================================================== KL
KL_TYPES: tuple[str, ...] = (
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
)  # fmt: skip


def _kl_forward(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        # clamp the exponent (±20) and then the estimate (±10), both as verl, for stability
        d = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(d) - d - 1, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL type {kind!r}; valid: {', '.join(KL_TYPES)}")


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
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    if kl_penalty not in KL_TYPES:
        raise ValueError(f"unknown KL type {kl_penalty!r}; valid: {', '.join(KL_TYPES)}")
    value = _kl_forward(log_prob, ref_log_prob, base)
    if not kl_penalty.endswith("+"):
        return value
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + value.detach()


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
