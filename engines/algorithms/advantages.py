"""Advantage estimators, registered by name (verl's ``register_adv_est``), and DAPO's overlong reward shaping."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel

from rlstage.engines.algorithms.masked import _group_ids, _group_stats, _group_sum, _safe_den, masked_whiten
from rlstage.engines.registry import Registry, check_flat_reads, settings_for
from rlstage.schemas.config import FLAT_ESTIMATOR_SETTINGS

Tensor = torch.Tensor
GroupIndex = Sequence[Hashable] | np.ndarray
AdvEstimatorFn = Callable[..., tuple[Tensor, Tensor]]


# ====================================================================== advantage estimators
# What each needs is declared where it is registered: ``critic`` (values), ``groups`` (n >= 2 samples a prompt),
# ``sum_pi_squared`` (the old policy's sum over the vocabulary of pi^2 per token, actor.calculate_sum_pi_squared).
ADV_ESTIMATORS: Registry[AdvEstimatorFn] = Registry("advantage estimator")


def _flat_reads(fn: AdvEstimatorFn) -> frozenset[str]:
    # compute_advantage passes an estimator exactly the arguments its signature names: so does it read verl's flat
    # algorithm.gamma, lam, norm_adv_by_std_in_grpo
    return frozenset(FLAT_ESTIMATOR_SETTINGS) & set(inspect.signature(fn).parameters)


def register_adv_estimator(
    name: str, *, needs: Iterable[str] = (), settings: type[BaseModel] | None = None
) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator: register an advantage estimator under ``name``, declaring what it ``needs`` and the model of its own
    ``settings`` (a pydantic model the config's ``algorithm.adv_estimator: {name: ..., <setting>: ...}`` is validated
    against; None: it takes none). The entry records which of verl's flat settings (``algorithm.gamma``, ``lam``,
    ``norm_adv_by_std_in_grpo``) it reads: those its signature names.

    An estimator is called with keyword arguments only, taking the subset of
    ``token_level_rewards, response_mask, index, values, reward_baselines, gamma, lam,
    norm_adv_by_std_in_grpo, epsilon, old_log_probs, sum_pi_squared, rollout_is_weights`` that its
    signature names, plus its own settings as keywords named as in its settings model; parameters without
    a default are required. It returns ``(advantages, returns)``, both ``[batch, response_len]``.
    """
    return ADV_ESTIMATORS.register(name, needs=needs, settings=settings, reads=_flat_reads)


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The registered estimator called ``name``; ValueError naming the registered ones otherwise."""
    return ADV_ESTIMATORS.entry(name).obj


def adv_estimator_settings(section: Any) -> BaseModel | None:
    """The typed settings of ``algorithm.adv_estimator`` (an ``AdvEstimatorConfig``: a name and the settings given
    beside it), validated against the estimator's registered model; ValueError with one line naming the setting
    otherwise."""
    return settings_for(ADV_ESTIMATORS.entry(section.name), section.settings, "algorithm.adv_estimator")


def check_estimator_reads(algorithm: Any) -> None:
    """ValueError (one line) when ``algorithm`` (the config's section) gives another value than the default to one of
    verl's flat estimator settings that its estimator does not read (``Entry.reads``)."""
    entry = ADV_ESTIMATORS.entry(algorithm.adv_estimator.name)
    check_flat_reads(entry, algorithm, FLAT_ESTIMATOR_SETTINGS, "algorithm")


def _float_mask(response_mask: Tensor, like: Tensor) -> Tensor:
    return response_mask.to(dtype=like.dtype, device=like.device)


@register_adv_estimator("gae", needs=("critic",))
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


@register_adv_estimator("grpo_vectorized", needs=("groups",))
@register_adv_estimator("grpo", needs=("groups",))
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


@register_adv_estimator("rloo", needs=("groups",))
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


@register_adv_estimator("rloo_vectorized", needs=("groups",))
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


@register_adv_estimator("reinforce_plus_plus_baseline", needs=("groups",))
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


@register_adv_estimator("opo", needs=("groups",))
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


@register_adv_estimator("gpg", needs=("groups",))
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


@register_adv_estimator("grpo_passk", needs=("groups",))
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


@register_adv_estimator("gdpo", needs=("groups",))
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


@register_adv_estimator("optimal_token_baseline", needs=("groups", "sum_pi_squared"))
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


@register_adv_estimator("tir_optimal_token_baseline", needs=("groups", "sum_pi_squared"))
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
    settings: BaseModel | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the estimator ``name`` and return ``(advantages, returns)``.

    Each estimator receives only the arguments its signature names, and its own ``settings`` (its typed settings
    model: ``adv_estimator_settings``) as keywords; a required one (no default) that is None here raises ValueError
    (``gae`` needs ``values``, ``remax`` ``reward_baselines``, the group estimators ``index``).
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
    kwargs: dict[str, Any] = dict(settings) if settings is not None else {}
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or pname in kwargs:
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
