"""engines/algorithms/aggregation.py: every loss aggregation mode by hand, token-sum, and data parallelism's
global counts."""

from __future__ import annotations

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import T, close

# ---------------------------------------------------------------- agg_loss
LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LMASK = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # middle row is empty


def test_agg_loss_by_hand_with_an_empty_row():
    close(A.agg_loss(LOSS, LMASK, "token-mean"), (1 + 2 + 24) / 5)
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-sum"), (3 + 24) / 2)  # the empty row is not counted
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-mean"), (1.5 + 8) / 2)
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-sum-norm"), (3 + 24) / 2 / 3)
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-sum-norm", loss_scale_factor=10), (3 + 24) / 2 / 10)


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_agg_loss_is_finite_with_empty_rows_and_empty_batches(mode):
    for mask in (LMASK, torch.zeros_like(LMASK)):
        x = LOSS.clone().requires_grad_(True)
        loss = A.agg_loss(x.masked_fill(mask == 0, float("nan")), mask, mode)
        loss.backward()
        assert torch.isfinite(loss), mode
        assert torch.isfinite(x.grad).all(), mode
    x = LOSS.clone().requires_grad_(True)
    A.agg_loss(x, LMASK, mode).backward()
    assert (x.grad[LMASK == 0] == 0).all() and (x.grad[LMASK == 1] > 0).all()


# ---------------------------------------------------------------- aggregation: token-sum, data-parallel global
def test_agg_loss_token_sum_and_global_counts_by_hand():
    close(A.agg_loss(LOSS, LMASK, "token-sum"), 1 + 2 + 24)
    close(A.agg_loss(LOSS, LMASK, "token-mean", dp_size=2, batch_num_tokens=10), 27 / 10 * 2)
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-sum", dp_size=2, global_batch_size=4), 27 / 4 * 2)
    close(A.agg_loss(LOSS, LMASK, "seq-mean-token-mean", dp_size=2, global_batch_size=4), (1.5 + 8) / 4 * 2)
    close(A.agg_loss(LOSS, LMASK, "token-sum", dp_size=2), 27 * 2)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        A.agg_loss(LOSS, LMASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        A.agg_loss(LOSS, LMASK, "seq-mean-token-mean", dp_size=2)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_data_parallel_shards_average_to_the_full_gradient(mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=g, requires_grad=True)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[4] = 0.0  # an empty row: not a sequence
    (full,) = torch.autograd.grad(A.agg_loss(x.square(), mask, mode), x)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    shard_grads = []
    for rows in (slice(0, 2), slice(2, 6)):  # unequal shards
        loss = A.agg_loss(
            x[rows].square(), mask[rows], mode, dp_size=2, batch_num_tokens=tokens, global_batch_size=seqs
        )
        (grad,) = torch.autograd.grad(loss, x)
        shard_grads.append(grad)
    # data parallelism averages the ranks' gradients
    close((shard_grads[0] + shard_grads[1]) / 2, full)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_seq_mean_token_sum_norm_divides_by_verls_loss_scale_factor(dp_size):
    """verl's convention (core_algos.agg_loss): seq-mean-token-sum-norm divides by ``loss_scale_factor`` when it is
    given, a constant whatever the padding, else by the padded width ``loss_mask.shape[-1]``. ``actor.loss_scale_factor``
    (verl's name) is that constant: with it the trainer's micro-batches, each padded to its own width, on any number
    of ranks, sum to the whole mini-batch's loss over the constant, which padding wider does not change."""
    mode, constant = "seq-mean-token-sum-norm", 16
    wide, wide_mask = torch.nn.functional.pad(LOSS, (0, 5)), torch.nn.functional.pad(LMASK, (0, 5))  # padded wider
    close(A.agg_loss(LOSS, LMASK, mode), (3 + 24) / 2 / 3)  # unset: the padded width, 3
    close(A.agg_loss(wide, wide_mask, mode), (3 + 24) / 2 / 8)  # ... which padding changes
    for loss, mask in ((LOSS, LMASK), (wide, wide_mask)):
        close(A.agg_loss(loss, mask, mode, loss_scale_factor=constant), (3 + 24) / 2 / constant)
    g = torch.Generator().manual_seed(3)
    lens = [5, 3, 0, 4, 1, 5, 2, 3]
    loss = torch.randn(len(lens), max(lens), generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (max(lens) - n) for n in lens])
    norm = A.agg_norm([row[:n].tolist() for row, n in zip(mask, lens, strict=True)], dp_size, scale_factor=constant)
    assert norm.agg_kwargs()["loss_scale_factor"] == constant
    parts = []
    for r in range(dp_size):
        rows = list(range(r, len(lens), dp_size))
        for m in (rows[i : i + 2] for i in range(0, len(rows), 2)):
            w = max(max(lens[i] for i in m), 1)  # each micro-batch padded to its own longest response
            parts.append(A.agg_loss(loss[m, :w], mask[m, :w], mode, **norm.agg_kwargs()))
    whole = (loss * mask).sum(-1).sum() / (mask.sum(-1) > 0).sum() / constant
    assert float(sum(parts) / dp_size) == pytest.approx(float(whole), rel=1e-5, abs=1e-6)
