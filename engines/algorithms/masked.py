"""Masked reductions and per-group statistics over ``[batch, len]`` tensors (verl's ``torch_functional``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

Tensor = torch.Tensor
GroupIndex = Sequence[Hashable] | np.ndarray


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
