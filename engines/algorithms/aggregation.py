"""Loss aggregation: ``agg_loss`` (verl's), the one reduction every loss and the trainer's micro-steps use."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlstage.engines.algorithms.masked import _safe_den, masked_sum
from rlstage.engines.registry import Registry

Tensor = torch.Tensor


# ====================================================================== loss aggregation
@dataclass(frozen=True)
class AggNorm:
    """The global counts of a mini-batch that ``agg_loss`` divides by when a rank computes one micro-batch
    of it (verl's ``global_batch_info``): the sum of the micro-batches' (and the ranks') losses is then
    ``agg_loss`` of the whole mini-batch on one process.

    ``dp_size``: data-parallel ranks whose gradients are AVERAGED; every rank holds the whole batch, so the
    global counts are its own to compute, and ``agg_loss`` multiplies by ``dp_size`` so that the average
    equals the single-process sum (verl's global token count times dp size).
    """

    tokens: float  # sum of the response mask
    seqs: float  # rows with at least one mask token
    width: int  # the padded response width (the mini-batch's longest response): seq-mean-token-sum-norm's divisor
    rows: float = 0.0  # all rows, empty ones included (geo_mean's mean over rows)
    dp_size: int = 1  # ranks sharing the mini-batch; their gradients are averaged
    scale_factor: int | None = None  # actor.loss_scale_factor (verl's): seq-mean-token-sum-norm's constant instead of width

    def agg_kwargs(self) -> dict[str, Any]:
        """``agg_loss``'s global-normalisation arguments."""
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.tokens,
            "global_batch_size": self.seqs,
            "loss_scale_factor": self.scale_factor if self.scale_factor is not None else max(1, self.width),
        }


def agg_norm(masks: Sequence[Sequence[float]], dp_size: int = 1, scale_factor: int | None = None) -> AggNorm:
    """The global counts of a mini-batch given every row's response mask (and the configured constant of
    seq-mean-token-sum-norm, if any)."""
    sums = [float(sum(m)) for m in masks]
    return AggNorm(
        tokens=sum(sums),
        seqs=float(sum(s > 0 for s in sums)),
        width=max((len(m) for m in masks), default=0),
        rows=float(len(masks)),
        dp_size=dp_size,
        scale_factor=scale_factor,
    )


def _global(agg: AggNorm | None) -> dict[str, Any]:
    return {} if agg is None else agg.agg_kwargs()


# An aggregation mode: ``fn(loss_mat, mask, tokens, seq_mask, *, dp_size, batch_num_tokens, global_batch_size,
# loss_scale_factor) -> scalar`` with ``mask`` the float mask, ``tokens`` its per-row sums and ``seq_mask`` the
# non-empty rows (agg_loss computes them once and checks the data-parallel arguments).
AggModeFn = Callable[..., Tensor]
LOSS_AGG_MODES: Registry[AggModeFn] = Registry("loss aggregation mode")
# The modes whose data-parallel normalisation needs the global token count (the others need the sequence count,
# or nothing: token-sum).
_NEEDS_TOKENS = {"token-mean"}


def register_loss_agg_mode(name: str, *, reads: Iterable[str] = ()) -> Callable[[AggModeFn], AggModeFn]:
    """Decorator: register an aggregation mode under ``name`` (its signature: ``AggModeFn`` above), declaring which of
    the actor's flat aggregation settings it ``reads`` (``FLAT_AGG_SETTINGS``: ``loss_scale_factor``); another value of
    one it does not read is refused at load."""
    return LOSS_AGG_MODES.register(name, reads=reads)


def _seqs(seq_mask: Tensor, global_batch_size: float | Tensor | None, like: Tensor) -> Tensor:
    return (
        seq_mask.sum() if global_batch_size is None else torch.as_tensor(global_batch_size, dtype=like.dtype)
    )


@register_loss_agg_mode("token-mean")
def _token_mean(loss_mat, mask, tokens, seq_mask, *, dp_size, batch_num_tokens, **kw) -> Tensor:
    """Mean over every policy token of the batch: each token weighs the same, long answers weigh more (verl's default, DAPO)."""
    den = mask.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=loss_mat.dtype)
    return masked_sum(loss_mat, mask) / _safe_den(den) * dp_size


@register_loss_agg_mode("token-sum")
def _token_sum(loss_mat, mask, tokens, seq_mask, *, dp_size, **kw) -> Tensor:
    """Sum over every policy token, no normalisation: the loss grows with batch and answer length."""
    return masked_sum(loss_mat, mask) * dp_size


@register_loss_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, tokens, seq_mask, *, dp_size, global_batch_size, **kw) -> Tensor:
    """Each answer's token sum, averaged over answers: longer answers weigh more, by their length."""
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    return (
        masked_sum(seq_losses, seq_mask) / _safe_den(_seqs(seq_mask, global_batch_size, loss_mat)) * dp_size
    )


@register_loss_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, tokens, seq_mask, *, dp_size, global_batch_size, **kw) -> Tensor:
    """Each answer's token mean, averaged over answers: every answer weighs the same (the original GRPO)."""
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / (tokens + 1e-8)
    return (
        masked_sum(seq_losses, seq_mask) / _safe_den(_seqs(seq_mask, global_batch_size, loss_mat)) * dp_size
    )


@register_loss_agg_mode("seq-mean-token-sum-norm", reads=("loss_scale_factor",))
def _seq_mean_token_sum_norm(loss_mat, mask, tokens, seq_mask, *, loss_scale_factor, **kw) -> Tensor:
    """Token sums over a constant (``actor.loss_scale_factor``, else the longest response): no length bias (Dr. GRPO)."""
    width = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return _seq_mean_token_sum(loss_mat, mask, tokens, seq_mask, **kw) / width


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
      padded width ``loss_mask.shape[-1]``, as verl's), the constant normaliser of Dr. GRPO. verl sums the rows'
      token sums where this averages them over the non-empty rows (``* dp_size``), as the other seq-mean modes.

    Data-parallel global normalisation: a rank that holds only its shard of a mini-batch passes the
    mini-batch's GLOBAL policy-token count ``batch_num_tokens`` (token-mean) or non-empty-row count
    ``global_batch_size`` (seq-mean modes) and the number of ranks ``dp_size``. Data-parallel training
    AVERAGES the ranks' gradients, so the ``* dp_size`` makes the averaged gradient that of the whole
    mini-batch on one rank. Without global counts the local ones are used (``dp_size`` must then be 1,
    as verl requires). Rows whose mask is all zero are excluded from the sequence count. Masked-out
    entries are dropped even if they hold NaN/inf. An empty batch gives 0 with a finite gradient (verl
    would divide 0 by 0).
    """
    mode = LOSS_AGG_MODES.entry(loss_agg_mode).obj
    mask = loss_mask.to(dtype=loss_mat.dtype, device=loss_mat.device)
    if dp_size > 1 and loss_agg_mode != "token-sum":
        key = "batch_num_tokens" if loss_agg_mode in _NEEDS_TOKENS else "global_batch_size"
        if {"batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size}[key] is None:
            raise ValueError(f"agg_loss: dp_size={dp_size} needs the global {key} of the mini-batch")
    tokens = mask.sum(dim=-1)
    seq_mask = (tokens > 0).to(loss_mat.dtype)
    return mode(
        loss_mat,
        mask,
        tokens,
        seq_mask,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
