"""engines/algorithms/masked.py: masked sums, means, variances, whitening and entropy, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import T, close


# ---------------------------------------------------------------- helpers
def test_masked_helpers_by_hand():
    x = T([[1.0, 2.0, float("nan")], [float("inf"), 5.0, 6.0]])
    m = T([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    close(A.masked_sum(x, m), 8.0)
    close(A.masked_sum(x, m, dim=-1), [3.0, 5.0])
    close(A.masked_mean(x, m), 8 / 3)
    close(A.masked_mean(x, m, dim=-1), [1.5, 5.0])
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0)
    # tokens 1, 2, 5: squared deviations 25/9 + 4/9 + 49/9 = 26/3
    close(A.masked_var(x, m, unbiased=False), 26 / 9)
    close(A.masked_var(x, m), 13 / 3)
    w = A.masked_whiten(x, m)
    close(w[0, 0], (1 - 8 / 3) / math.sqrt(13 / 3 + 1e-8))
    close(A.masked_whiten(x, m, shift_mean=False)[0, 0], (1 - 8 / 3) / math.sqrt(13 / 3 + 1e-8) + 8 / 3)


def test_masked_mean_of_empty_mask_is_zero_and_unbiased_var_needs_two_tokens():
    x = torch.arange(4.0).reshape(2, 2)
    close(A.masked_mean(x, torch.zeros(2, 2)), 0.0)
    with pytest.raises(ValueError):
        A.masked_var(x, T([[0.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(ValueError):
        A.masked_var(x, torch.zeros(2, 2))


def test_entropy_from_logits():
    close(A.entropy_from_logits(torch.zeros(2, 4)), [math.log(4)] * 2)
    p = T([0.5, 0.25, 0.25])
    close(A.entropy_from_logits(p.log() + 3.0), -(p * p.log()).sum())
