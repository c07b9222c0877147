"""The RL math of rlstage: advantage estimators, policy losses, loss aggregation and KL terms.

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
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor
GroupIndex = Sequence[Hashable] | np.ndarray
AdvEstimatorFn = Callable[..., tuple[Tensor, Tensor]]
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

__all__ = [
    "ADV_ESTIMATORS",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
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
    "register_adv_estimator",
    "register_policy_loss",
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
    norm_adv_by_std_in_grpo, epsilon`` that its signature names; parameters without a default are
    required. It returns ``(advantages, returns)``, both ``[batch, response_len]``.
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
    A one-member group keeps its raw score, ``A_i = s_i`` (verl's ``rloo`` estimator leaves it
    untouched; only verl's separate ``rloo_vectorized`` zeroes it). No std, no eps.
    Output ``A_i * response_mask``; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    st = _group_stats(scores, index)
    s, n = scores.to(torch.float64), st["count"]
    loo = (n * s - st["total"]) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, loo, s)
    out = adv.to(scores.dtype).unsqueeze(-1) * _float_mask(response_mask, scores)
    return out, out


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the batch.

    Backwards over t: ``G = r_t + gamma * G; returns_t = G; G <- G * m_t``. The running return is
    reset to 0 right after every masked position, so a return never crosses a gap: tokens before a
    tool-output gap do not see rewards placed after it (verl's "reset after EOS", applied at every 0 of
    the mask). ``returns`` is left unmasked. Advantages are ``masked_whiten(returns) * response_mask``
    (token-weighted mean, unbiased variance, eps 1e-8 under the rsqrt).
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
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


# ====================================================================== loss aggregation
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, *, loss_scale_factor: float | None = None
) -> Tensor:
    """Reduce a ``[batch, len]`` loss matrix to a scalar (verl 0.9.1 semantics, one data-parallel rank).

    - ``token-mean``: ``sum(L * m) / sum(m)``; every policy token weighs the same.
    - ``seq-mean-token-sum``: per row ``sum_t L * m``, then the mean over NON-EMPTY rows.
    - ``seq-mean-token-mean``: per row ``sum_t L * m / (sum_t m + 1e-8)``, then the mean over NON-EMPTY
      rows.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by ``loss_scale_factor`` (default: the
      padded width ``loss_mask.shape[-1]``), the constant normaliser of Dr. GRPO.

    Rows whose mask is all zero are excluded from the sequence count (verl 0.9.1 does this; older verl
    took a plain ``torch.mean`` over all rows, diluting the loss). Masked-out entries are dropped even if
    they hold NaN/inf. If the whole batch is empty the result is 0 with a finite gradient (verl would
    divide 0 by 0 in ``token-mean`` and in the seq-mean modes).
    """
    mask = loss_mask.to(dtype=loss_mat.dtype, device=loss_mat.device)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / _safe_den(mask.sum())
    tokens = mask.sum(dim=-1)
    seq_mask = (tokens > 0).to(loss_mat.dtype)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
        loss = masked_sum(seq_losses, seq_mask) / _safe_den(seq_mask.sum())
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_sum(loss_mat, mask, dim=-1) / (tokens + 1e-8)
        return masked_sum(seq_losses, seq_mask) / _safe_den(seq_mask.sum())
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


# ====================================================================== policy losses
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name``.

    Signature: ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *,
    clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, **kw) -> (loss, metrics)`` where metrics
    holds detached scalars ``pg_clipfrac``, ``ppo_kl`` and ``pg_clipfrac_lower``.
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
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual-clip.

    ``d = clamp(log_prob - old_log_prob, -20, 20)`` (clamped before ``exp`` so the ratio stays finite),
    ``r = exp(d)``; per token::

        L1 = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L  = min(L1, -A clip_ratio_c)   where A < 0      (dual-clip, Ye et al. 2019)
        L  = L1                         where A >= 0

    Dual-clip only ever bounds the loss of NEGATIVE advantages (``clip_ratio_c > 1`` required).
    Aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``. Metrics (token-mean over the mask):
    ``pg_clipfrac`` = share of tokens where the clipped term is the larger one, ``pg_clipfrac_lower`` =
    share of negative-advantage tokens where dual-clip bit, ``ppo_kl`` = masked mean of ``-d``.
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
    pg_losses = torch.where(negative, dual, clipped)
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    return loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


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
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: clipped surrogate on the sequence-level (length-normalised) importance ratio.

    ``log s_i = sum_t m_t (log_prob - old_log_prob) / max(1, sum_t m_t)`` (geometric mean of the token
    ratios over policy tokens). Per token the ratio is
    ``s_it = exp(min(10, sg(log s_i) + log_prob - sg(log_prob)))``: its value is ``s_i`` and its gradient
    is that of ``s_i * log_prob`` token by token. No ±20 clamp here; the log-ratio is clamped at +10 only.
    Loss per token ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``, no dual-clip.

    Aggregation is always ``seq-mean-token-mean`` as in verl, whatever ``loss_agg_mode`` says.
    ``pg_clipfrac`` = masked share of clipped tokens, ``pg_clipfrac_lower`` = 0,
    ``ppo_kl`` = masked mean of ``old_log_prob - log_prob`` (unclamped).
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss1 = -advantages * seq_ratio
    loss2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(loss1, loss2)
    loss = agg_loss(pg_losses, mask, "seq-mean-token-mean")
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).to(mask.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, torch.zeros((), dtype=loss.dtype, device=loss.device))


@register_policy_loss("gpg")
def policy_loss_gpg(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: plain policy gradient, ``L = -log_prob * A`` per token, no ratio and no clipping.

    Aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``. Both clip fractions are 0 (nothing is
    clipped); ``ppo_kl`` is still reported as the masked mean of ``old_log_prob - log_prob`` for
    monitoring (verl 0.9.1 returns no metrics for this loss).
    """
    mask = response_mask.to(log_prob.dtype)
    loss = agg_loss(-log_prob * advantages, mask, loss_agg_mode)
    ppo_kl = masked_mean((old_log_prob - log_prob).detach(), mask)
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return loss, _metrics(zero, ppo_kl, zero)


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
    clip_ratio_c: float = 3.0,
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
    pg_losses = -weight.detach() * advantages * log_prob
    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    pg_clipfrac = masked_mean(torch.ne(ratio, weight).to(mask.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, torch.zeros((), dtype=loss.dtype, device=loss.device))


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
