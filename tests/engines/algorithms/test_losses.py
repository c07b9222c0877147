"""engines/algorithms/losses.py: every policy loss and the value loss by hand and against verl's conventions."""

from __future__ import annotations

import math

import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import T, close


# ---------------------------------------------------------------- policy losses
def test_vanilla_by_hand():
    ratio = T([[1.5, 0.5, 1.1, 4.0]])
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    loss, m = A.get_policy_loss("vanilla")(torch.zeros(1, 4), ratio.log(), adv, torch.ones(1, 4))
    # per token: max(-1.5, -1.2), max(-0.5, -0.8), 1.1, min(3, max(4, 1.2))
    close(loss, (-1.2 - 0.5 + 1.1 + 3.0) / 4)
    close(m["pg_clipfrac"], 0.25)
    close(m["pg_clipfrac_lower"], 0.25)
    close(m["ppo_kl"], -ratio.log().mean())
    assert set(m) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}


def test_vanilla_asymmetric_clip():
    ratio = T([[1.3, 0.7]])
    loss, _ = A.policy_loss_vanilla(
        torch.zeros(1, 2), ratio.log(), T([[1.0, -1.0]]), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    close(loss, (-1.28 + 0.8) / 2)


def test_dual_clip_only_affects_negative_advantages():
    lp = T([[math.log(4.0)]])
    for adv, expected in ((1.0, {3.0: -1.2, 10.0: -1.2}), (-1.0, {3.0: 3.0, 10.0: 4.0})):
        for c, value in expected.items():
            loss, m = A.policy_loss_vanilla(torch.zeros(1, 1), lp, T([[adv]]), torch.ones(1, 1), clip_ratio_c=c)
            close(loss, value)
            close(m["pg_clipfrac_lower"], 1.0 if (adv < 0 and c == 3.0) else 0.0)
    with pytest.raises(ValueError):
        A.policy_loss_vanilla(torch.zeros(1, 1), lp, T([[1.0]]), torch.ones(1, 1), clip_ratio_c=1.0)


def test_log_ratio_is_clamped_at_20():
    old = torch.zeros(1, 3)
    lp = T([[100.0, -100.0, 50.0]], requires_grad=True)
    adv = T([[-1.0, 1.0, 1.0]])
    for name in ("vanilla", "cispo"):
        loss, m = A.get_policy_loss(name)(old, lp, adv, torch.ones(1, 3))
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
        close(m["ppo_kl"], -(20 - 20 + 20) / 3)
    loss, _ = A.policy_loss_vanilla(old, lp, adv, torch.ones(1, 3))
    close(loss, (3.0 - math.exp(-20) - 1.2) / 3)  # dual clip, unclipped tiny ratio, upper clip


def test_policy_losses_ignore_garbage_in_gaps():
    mask = T([[1.0, 0.0, 1.0]])
    lp = T([[-0.5, float("nan"), -0.2]])
    old = T([[-0.4, float("inf"), -0.3]])
    adv = T([[1.0, float("nan"), -1.0]])
    for name in A.POLICY_LOSSES:
        for mode in A.LOSS_AGG_MODES:
            loss, metrics = A.get_policy_loss(name)(old, lp, adv, mask, mode, dro_beta=0.1)
            assert torch.isfinite(loss), (name, mode)
            assert all(torch.isfinite(v) for v in metrics.values()), (name, mode)


def test_gspo_uses_sequence_ratio_and_the_given_aggregation():
    old = torch.zeros(2, 3)
    lp = T([[0.2, 0.4, 7.0], [-0.1, 0.0, -0.2]], requires_grad=True)
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    s1 = math.exp(-0.1)  # geometric-mean ratio of row 1; row 0's exp(0.3) is clipped at 1.2
    # verl 0.9.1 aggregates GSPO with the loss_agg_mode it is given
    expected = {
        "seq-mean-token-mean": (-1.2 + s1) / 2,
        "token-mean": (2 * -1.2 + 3 * s1) / 5,
        "seq-mean-token-sum": (2 * -1.2 + 3 * s1) / 2,
        "token-sum": 2 * -1.2 + 3 * s1,
    }
    for mode, value in expected.items():
        loss, m = A.policy_loss_gspo(old, lp, adv, mask, mode)
        close(loss, value)
    close(m["pg_clipfrac"], 2 / 5)
    close(m["pg_clipfrac_lower"], 0.0)
    loss, _ = A.policy_loss_gspo(old, lp, adv, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, 0.0, 0.0], [s1 / 6, s1 / 6, s1 / 6]])  # -A * s_i / (len_i * n_seq)
    loss, _ = A.policy_loss_gspo(old, lp, adv, mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, 0.0, 0.0], [s1 / 5, s1 / 5, s1 / 5]])


def test_cispo_by_hand():
    ratio = T([[1.5, 0.5, 1.0]])
    lp = ratio.log().requires_grad_(True)
    adv = T([[1.0, -1.0, 2.0]])
    loss, m = A.policy_loss_cispo(torch.zeros(1, 3), lp, adv, torch.ones(1, 3))
    close(loss, (-1.2 * math.log(1.5) - 0.8 * math.log(2.0) + 0.0) / 3)
    close(m["pg_clipfrac"], 2 / 3)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[-1.2 / 3, 0.8 / 3, -2.0 / 3]])  # weight is a constant: -w * A / N


def test_gpg_policy_loss_is_plain_policy_gradient():
    lp = T([[-0.5, -1.0, -2.0]], requires_grad=True)
    adv = T([[1.0, -2.0, 5.0]])
    mask = T([[1.0, 1.0, 0.0]])
    loss, m = A.policy_loss_gpg(torch.zeros(1, 3), lp, adv, mask)
    close(loss, (0.5 - 2.0) / 2)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[-0.5, 1.0, 0.0]])
    close(m["pg_clipfrac"], 0.0)


# ---------------------------------------------------------------- value loss
def test_value_loss_by_hand():
    vpreds = T([[1.0, 2.0, 1.0, 50.0]])
    values = T([[0.0, 2.0, 0.0, 0.0]])
    returns = T([[0.5, 3.0, 2.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = A.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # max((v-R)^2, (clip(v)-R)^2) = 0.25, 1.0, max(1, 2.25)
    close(loss, 0.5 * (0.25 + 1.0 + 2.25) / 3)
    close(clipfrac, 1 / 3)


# ---------------------------------------------------------------- verl parity, part 2: policy losses
def test_sapo_gate_by_hand():
    old = torch.zeros(1, 3)
    ratio = T([[1.5, 1.0, 0.5]])
    lp = ratio.log().requires_grad_(True)
    adv = T([[1.0, -2.0, -1.0]])
    mask = T([[1.0, 1.0, 1.0]])
    loss, m = A.policy_loss_sapo(old, lp, adv, mask, "token-mean", tau_pos=1.0, tau_neg=1.05)

    def gate(r, tau):
        return 1 / (1 + math.exp(-tau * (r - 1))) * 4 / tau

    per_token = [-gate(1.5, 1.0) * 1.0, gate(1.0, 1.05) * 2.0, gate(0.5, 1.05) * 1.0]
    close(loss, sum(per_token) / 3)  # seq-mean-token-mean whatever loss_agg_mode says (one row here)
    close(m["pg_clipfrac"], 0.0)
    # at r = 1 the gate's slope is 1: the gradient there is PPO's (-A r grad log r = -A)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad[0, 1], 2.0 / 3)
    two_rows, _ = A.policy_loss_sapo(torch.zeros(2, 2), torch.zeros(2, 2), T([[1.0, 1.0], [1.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]]), "token-mean")
    close(two_rows, -2.0)  # per row mean of -A * 2/tau, then mean over rows


def test_dppo_tv_and_kl_by_hand():
    old = T([[0.5, 0.5, 0.5, 0.5]]).log()
    p = T([[0.8, 0.6, 0.3, 0.45]])
    lp = p.log().requires_grad_(True)
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    # TV: A>0 keeps p - q <= 0.2: 0.3 dropped, 0.1 kept; A<0 keeps p - q >= -0.1: -0.2 dropped, -0.05 kept
    loss, m = A.policy_loss_dppo_tv(old, lp, adv, mask, "token-mean", clip_ratio_low=0.1, clip_ratio_high=0.2, clip_ratio_c=1.1)
    kept = [0, 1, 0, 1]
    w = [min(pi / 0.5, 1.1) for pi in (0.8, 0.6, 0.3, 0.45)]
    close(loss, sum(-a * wi * math.log(pi) * k for a, wi, pi, k in zip([1, 1, -1, -1], w, [0.8, 0.6, 0.3, 0.45], kept, strict=True)) / 4)
    close(m["pg_clipfrac"], 0.5)
    close(m["pg_clipfrac_lower"], 1 / 4)  # kept token 1 has ratio 1.2 > 1.1
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, -w[1] / 4, 0.0, w[3] / 4]])  # the truncated ratio is a constant
    # binary KL
    def bkl(q, pp):
        return q * math.log(q / pp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - pp + 1e-8))

    loss, m = A.policy_loss_dppo_kl(old, lp, adv, mask, "token-mean", clip_ratio_low=0.02, clip_ratio_high=0.05)
    # A>0: kept if KL <= 0.05 or p <= q;  A<0: kept if KL <= 0.02 or p >= q
    kept = [bkl(0.5, 0.8) <= 0.05, bkl(0.5, 0.6) <= 0.05, bkl(0.5, 0.3) <= 0.02, bkl(0.5, 0.45) <= 0.02]
    assert kept == [False, True, False, True]
    close(m["pg_clipfrac"], 0.5)
    w = [min(pi / 0.5, 3.0) for pi in (0.8, 0.6, 0.3, 0.45)]  # clip_ratio_c: the settings model's default
    close(loss, (-w[1] * math.log(0.6) + w[3] * math.log(0.45)) / 4)


def test_clip_cov_drops_gradient_of_high_covariance_tokens():
    old = torch.zeros(1, 4)
    lp = T([[0.0, 0.0, -2.0, 0.0]], requires_grad=True)
    adv = T([[3.0, -3.0, -3.0, 1.0]])
    mask = torch.ones(1, 4)
    # cov = (A - 0.5)(lp - (-0.5)): 1.25, -1.75, 5.25, 0.25; only token 0 lies in (1, 5) and is unclipped
    loss, m = A.policy_loss_clip_cov(old, lp, adv, mask, "token-mean", clip_cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    r2 = math.exp(-2.0)  # token 2: A<0, ratio below 0.8 -> PPO takes the unclipped -A r (max of the two)
    close(loss, (0 + 3.0 + max(3 * r2, 3 * 0.8) - 1.0) / 4)
    close(m["pg_clipfrac"], 0.25)
    assert set(m) == {"pg_clipfrac", "ppo_kl"}
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 0] == 0.0 and grad[0, 1] != 0.0
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        A.policy_loss_clip_cov(old, lp, adv, mask, clip_cov_ratio=0.0)


def test_kl_cov_penalises_the_top_covariance_tokens():
    old = torch.zeros(1, 4)
    lp = T([[0.1, 0.0, -2.0, 0.2]], requires_grad=True)
    adv = T([[3.0, -3.0, -3.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, m = A.policy_loss_kl_cov(old, lp, adv, mask, "token-mean", kl_cov_ratio=0.5, ppo_kl_coef=0.1)
    # cov (means 0.5 and -0.425): token 2 = (-3.5)(-1.575) and token 0 = (2.5)(0.525) are the top two
    base = [-3 * math.exp(0.1), 3 * 1.0, 3 * math.exp(-2.0), -1 * math.exp(0.2)]
    pen = [0.1 * 0.1, 0.0, 0.1 * 2.0, 0.0]
    close(loss, sum(b + q for b, q in zip(base, pen, strict=True)) / 4)
    close(m["ppo_kl"], (0.1 + 0 + 2 + 0.2) / 4)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        A.policy_loss_kl_cov(old, lp, adv, mask, kl_cov_ratio=0.0)


def test_geo_mean_by_hand():
    old = torch.zeros(3, 2)
    lp = T([[0.1, 0.5], [-0.1, -0.6], [0.0, 0.0]], requires_grad=True)
    adv = T([[1.0, 1.0], [-2.0, -2.0], [0.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # an empty third row still counts in the mean
    loss, m = A.policy_loss_geo_mean(old, lp, adv, mask, "token-sum", clip_ratio_low=0.4, clip_ratio_high=0.4)
    # A>0: min(d, clamp(d)) -> 0.1, 0.4; A<0: -min(-d, -clamp(d)) = max(d, clamp(d)) -> -0.1, -0.4
    rho0 = math.exp((0.1 + 0.4) / 2)
    rho1 = math.exp((-0.1 - 0.4) / 2)
    close(loss, (-1.0 * rho0 + 2.0 * rho1 + 0.0) / 3)
    close(m["pg_clipfrac"], 1 / 4)  # token (0, 1) clamped with A > 0
    close(m["pg_clipfrac_lower"], 1 / 4)
    w = T([[4.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    weighted, _ = A.policy_loss_geo_mean(old, lp, adv, mask, clip_ratio_low=0.4, clip_ratio_high=0.4, rollout_is_weights=w)
    close(weighted, (-1.0 * rho0 * 2.0 + 2.0 * rho1) / 3)  # row weight: geometric mean of (4, 1) = 2


def test_dro_by_hand():
    old = T([[0.0, -1.0]])
    lp = T([[-0.5, -0.5]], requires_grad=True)
    adv = T([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, m = A.policy_loss_dro(old, lp, adv, mask, "token-mean", dro_beta=0.2)
    close(loss, (-(-0.5 * 1 - 0.1 * 0.25) - (-0.5 * -1 - 0.1 * 0.25)) / 2)
    close(m["ppo_kl"], (0.5 - 0.5) / 2)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[(-1 + 0.2 * -0.5) / 2, (1 + 0.2 * 0.5) / 2]])
    with pytest.raises(ValueError, match="dro_beta"):
        A.policy_loss_dro(old, lp, adv, mask)


def test_bypass_reinforce_with_and_without_is_weights():
    rollout = T([[-1.0, -1.0, -1.0]])
    lp = T([[-1.0 + math.log(3.0), -1.0, -1.0 - math.log(2.0)]], requires_grad=True)
    adv = T([[1.0, 2.0, -1.0]])
    mask = torch.ones(1, 3)
    plain, m = A.policy_loss_bypass_mode(rollout, lp, adv, mask, "token-mean", loss_type="reinforce")
    close(plain, -(1.0 * lp[0, 0] + 2.0 * -1.0 + -1.0 * lp[0, 2]).item() / 3)
    assert "rollout_corr/kl" in m and "rollout_corr/rollout_is_mean" not in m
    weighted, m = A.policy_loss_bypass_mode(
        rollout, lp, adv, mask, "token-mean", loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0
    )
    # w = pi / pi_rollout = (3 -> truncated 2, 1, 0.5), a constant weight on -A log pi
    (grad,) = torch.autograd.grad(weighted, lp)
    close(grad, [[-1.0 * 2.0 / 3, -2.0 / 3, 1.0 * 0.5 / 3]])
    close(m["rollout_corr/rollout_is_mean"], (2.0 + 1.0 + 0.5) / 3)
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3)
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.0)  # 0.5 is not below 1/2
    # ppo_clip: vanilla PPO against the rollout policy, no extra weights
    clip, _ = A.policy_loss_bypass_mode(rollout, lp, adv, mask, "token-mean", rollout_is="token")
    vanilla, _ = A.policy_loss_vanilla(rollout, lp, adv, mask, "token-mean")
    close(clip, vanilla)


def test_rollout_is_weights_multiply_every_loss():
    g = torch.Generator().manual_seed(0)
    old, lp, adv = (torch.randn(2, 3, generator=g) * 0.1 for _ in range(3))
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ones = torch.ones(2, 3)
    for name in A.POLICY_LOSSES:
        if name == "bypass_mode":
            continue  # computes its own weights
        kw = dict(dro_beta=0.1, generator=torch.Generator().manual_seed(0))
        base, _ = A.get_policy_loss(name)(old, lp, adv, mask, "token-sum", rollout_is_weights=ones, **kw)
        kw["generator"] = torch.Generator().manual_seed(0)
        doubled, _ = A.get_policy_loss(name)(old, lp, adv, mask, "token-sum", rollout_is_weights=2 * ones, **kw)
        close(doubled, 2 * base)
