"""engines/algorithms/kl.py: every KL estimator and the KL controllers by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import VERL_NAMES, T, close


# ---------------------------------------------------------------- KL
def test_kl_estimators_by_hand():
    lp, ref = T([0.0, -1.0]), T([-0.5, -0.2])
    close(A.kl_penalty(lp, ref, "kl"), [0.5, -0.8])
    close(A.kl_penalty(lp, ref, "abs"), [0.5, 0.8])
    close(A.kl_penalty(lp, ref, "mse"), [0.125, 0.32])
    close(A.kl_penalty(lp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(0.8) - 0.8 - 1])
    for a, b in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        torch.testing.assert_close(A.kl_penalty(lp, ref, a), A.kl_penalty(lp, ref, b))


def test_k3_is_clamped():
    lp, ref = T([0.0, 0.0, 0.0]), T([20.0, -50.0, 50.0])
    close(A.kl_penalty(lp, ref, "low_var_kl"), [10.0, 10.0, 10.0])
    assert torch.isfinite(A.kl_penalty(lp, ref, "k3+")).all()


@pytest.mark.parametrize("name", [n for n in VERL_NAMES["KL_TYPES"] if n.endswith("+")])
def test_plus_variants_have_base_value_and_k2_gradient(name):
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(5, generator=g)
    lp = (ref + torch.randn(5, generator=g)).requires_grad_(True)
    value = A.kl_penalty(lp, ref, name)
    torch.testing.assert_close(value, A.kl_penalty(lp.detach(), ref, name[:-1]))
    (grad,) = torch.autograd.grad(value.sum(), lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    (k2_grad,) = torch.autograd.grad(A.kl_penalty(lp2, ref, "k2").sum(), lp2)
    torch.testing.assert_close(grad, k2_grad)
    torch.testing.assert_close(grad, (lp - ref).detach())
    if name in ("k3+", "kl+"):
        lp3 = lp.detach().clone().requires_grad_(True)
        (base_grad,) = torch.autograd.grad(A.kl_penalty(lp3, ref, name[:-1]).sum(), lp3)
        assert not torch.allclose(base_grad, grad)  # the straight-through actually changes the gradient


def test_adaptive_kl_controller_and_state():
    ctrl = A.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=12.0, n_steps=256)  # error clipped to +0.2
    close(T(ctrl.value), 0.1 * (1 + 0.2 * 256 / 10000))
    ctrl.update(current_kl=6.6, n_steps=1000)  # error 0.1
    v = 0.1 * (1 + 0.2 * 256 / 10000) * (1 + 0.1 * 1000 / 10000)
    close(T(ctrl.value), v)
    fresh = A.get_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value
    fixed = A.FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError):
        fixed.load_state_dict(ctrl.state_dict())
    with pytest.raises(ValueError):
        A.AdaptiveKLController(0.1, 6.0, 0)


def test_apply_kl_penalty():
    scores = T([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = T([[0.5, 0.5, 9.0], [0.2, 0.0, 0.0], [1.0, 1.0, 1.0]])
    ref = torch.zeros(3, 3)
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ctrl = A.AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    rewards, metrics = A.apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    close(rewards, [[-0.05, 0.95, 0.0], [1.98, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the coefficient before the update
    close(T(metrics["actor/reward_kl_penalty"]), (0.5 + 0.2 + 0.0) / 3)  # per-row means, empty row = 0
    close(T(ctrl.value), 0.1 * (1 - 0.2 * 3 / 100))
