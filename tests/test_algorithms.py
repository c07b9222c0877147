"""Tests of engines/algorithms/: hand-computed cases, verl conventions, invariants."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest
import torch

from rlstage.engines import algorithms as A

T = torch.tensor


def close(x: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(x).double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-5)


def outcome(scores, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with each score on the last policy token of its row."""
    mask = T(masks, dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for i, s in enumerate(scores):
        last = int(mask[i].nonzero().max()) if mask[i].any() else mask.shape[1] - 1
        rewards[i, last] = s
    return rewards, mask


def whiten_tokens(values: list[float]) -> tuple[float, float]:
    """Mean and 1/sqrt(unbiased var + 1e-8) of a plain token list, computed independently."""
    return statistics.fmean(values), 1 / math.sqrt(statistics.variance(values) + 1e-8)


# ragged masks with a gap inside row 0 and row 2 (multi-turn tool output)
MASKS = [
    [1, 1, 0, 0, 1, 1, 0],
    [1, 1, 1, 0, 0, 0, 0],
    [1, 0, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0],
]
INDEX = ["a", "a", "a", "b", "c", "c"]  # a: three members, b: one member, c: constant pair
SCORES = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]


# ---------------------------------------------------------------- names
# verl 0.9.1's names: the registries hold each built in (a plugin may add more, engines/plugins.py)
VERL_NAMES = {
    "ADV_ESTIMATORS": (
        "gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline",
        "tir_optimal_token_baseline",
    ),
    "POLICY_LOSSES": (
        "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
        "bypass_mode",
    ),
    "LOSS_AGG_MODES": ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "KL_TYPES": (
        "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
    ),
}  # fmt: skip


@pytest.mark.parametrize("registry", sorted(VERL_NAMES))
def test_registries_hold_verls_names(registry):
    names = [n for n in getattr(A, registry) if getattr(A, registry).entry(n).module.startswith("rlstage.")]
    assert sorted(names) == sorted(VERL_NAMES[registry])


def test_estimators_declare_what_they_need():
    needs = {n: A.ADV_ESTIMATORS.entry(n).needs for n in A.ADV_ESTIMATORS}
    assert {n for n, k in needs.items() if "critic" in k} == {"gae"}
    assert {n for n, k in needs.items() if "sum_pi_squared" in k} == {"optimal_token_baseline", "tir_optimal_token_baseline"}
    # the estimators that compare samples within a prompt's group
    assert {n for n, k in needs.items() if "groups" in k} == {
        "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline", "opo", "gpg",
        "grpo_passk", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline",
    }  # fmt: skip


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="grpo"):
        A.get_adv_estimator("ppo")
    with pytest.raises(ValueError, match="cispo"):
        A.get_policy_loss("dapo")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        A.agg_loss(torch.ones(1, 2), torch.ones(1, 2), "sum")
    with pytest.raises(ValueError, match="low_var_kl"):
        A.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_reregistering_a_name_with_another_function_fails():
    with pytest.raises(ValueError, match="'grpo' is registered twice: by rlstage.engines.algorithms.advantages and by"):
        A.register_adv_estimator("grpo")(lambda **kw: None)
    with pytest.raises(ValueError, match="registered twice"):
        A.register_policy_loss("vanilla")(lambda *a, **kw: None)
    assert A.ADV_ESTIMATORS["grpo"] is A.grpo_advantage


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


# ---------------------------------------------------------------- GAE
def test_gae_by_hand_full_mask():
    adv, ret = A.compute_advantage(
        "gae", token_level_rewards=T([[0.0, 0.0, 1.0]]), response_mask=torch.ones(1, 3),
        values=T([[0.5, 0.2, 0.1]]), gamma=1.0, lam=1.0,
    )  # fmt: skip
    raw = [0.5, 0.8, 0.9]  # deltas -0.3, -0.1, 0.9 accumulated backwards
    close(ret, [[1.0, 1.0, 1.0]])
    mean, inv_std = whiten_tokens(raw)
    close(adv, [[(r - mean) * inv_std for r in raw]])


def test_gae_jumps_over_a_gap():
    # mask 1 0 1: the gap token keeps next-value 0.1 and the running advantage 0.9
    adv, ret = A.compute_advantage(
        "gae", token_level_rewards=T([[0.0, 0.0, 1.0]]), response_mask=T([[1.0, 0.0, 1.0]]),
        values=T([[0.5, 9.0, 0.1]]), gamma=0.9, lam=0.8,
    )  # fmt: skip
    a0 = 0.9 * 0.1 - 0.5 + 0.9 * 0.8 * 0.9  # 0.238
    raw = [a0, 0.9, 0.9]
    close(ret, [[a0 + 0.5, 0.9 + 9.0, 1.0]])
    mean, inv_std = whiten_tokens([a0, 0.9])
    close(adv, [[(r - mean) * inv_std for r in raw]])


def test_gae_ignores_values_at_masked_positions():
    g = torch.Generator().manual_seed(0)
    mask = T(MASKS, dtype=torch.float32)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    other = torch.where(mask.bool(), values, torch.randn(mask.shape, generator=g) * 100)
    kw = dict(token_level_rewards=rewards, response_mask=mask, gamma=0.95, lam=0.9)
    adv1, ret1 = A.compute_advantage("gae", values=values, **kw)
    adv2, ret2 = A.compute_advantage("gae", values=other, **kw)
    torch.testing.assert_close(adv1, adv2)
    torch.testing.assert_close(ret1[mask.bool()], ret2[mask.bool()])
    assert not torch.equal(ret1, ret2)  # returns = A + V still shows V at masked slots


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        A.compute_advantage("gae", token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3))


# ---------------------------------------------------------------- group estimators by hand
def test_grpo_by_hand():
    rewards, mask = outcome(SCORES, MASKS)
    adv, ret = A.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    std_a = math.sqrt(1 / 3)  # unbiased std of 1, 0, 0
    per_row = [(2 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), 0.5 / (1 + 1e-6), 0, 0]
    close(adv, T(per_row).unsqueeze(-1) * mask)
    assert adv is ret or torch.equal(adv, ret)
    assert (adv[mask == 0] == 0).all()  # zero in the gaps too


def test_dr_grpo_skips_std():
    rewards, mask = outcome(SCORES, MASKS)
    adv, _ = A.compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=mask, index=INDEX, norm_adv_by_std_in_grpo=False
    )
    close(adv, T([2 / 3, -1 / 3, -1 / 3, 0.5, 0.0, 0.0]).unsqueeze(-1) * mask)


def test_grpo_epsilon_is_added_to_std():
    rewards, mask = outcome([1.0, 0.0], [[1, 1], [1, 1]])
    adv, _ = A.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=[0, 0], epsilon=0.5)
    s = math.sqrt(0.5)  # unbiased std of (1, 0)
    close(adv[:, 0], [0.5 / (s + 0.5), -0.5 / (s + 0.5)])


def test_rloo_by_hand_keeps_raw_score_of_a_lone_sample():
    rewards, mask = outcome(SCORES, MASKS)
    adv, _ = A.compute_advantage("rloo", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    close(adv, T([1.0, -0.5, -0.5, 0.5, 0.0, 0.0]).unsqueeze(-1) * mask)


def test_opo_uses_length_weighted_baseline():
    masks = [[1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]  # lengths 2, 3, 1 (gap not counted), 3
    rewards, mask = outcome([1.0, 0.0, 1.0, 0.7], masks)
    adv, _ = A.compute_advantage("opo", token_level_rewards=rewards, response_mask=mask, index=["g", "g", "g", "h"])
    b = (2 * 1 + 3 * 0 + 1 * 1) / 6  # 0.5, while the plain mean would be 2/3
    close(adv, T([1 - b, 0 - b, 1 - b, 0.7]).unsqueeze(-1) * mask)


def test_gpg_scales_by_batch_over_nonzero_count():
    rewards, mask = outcome([1.0, 0.0, 2.0], [[1, 1], [1, 0], [1, 1]])
    adv, _ = A.compute_advantage("gpg", token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b"])
    alpha = 3 / 2
    close(adv, T([alpha * 0.5, alpha * -0.5, alpha * 2.0]).unsqueeze(-1) * mask)


def test_reinforce_plus_plus_baseline_whitens_over_tokens():
    masks = [[1, 1, 0], [1, 0, 1], [1, 1, 1]]
    rewards, mask = outcome([1.0, 0.0, 2.0], masks)
    adv, ret = A.compute_advantage(
        "reinforce_plus_plus_baseline", token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b"]
    )
    centred = [0.5, -0.5, 2.0]
    tokens = [c for c, m in zip(centred, masks, strict=True) for _ in range(sum(m))]  # 2 + 2 + 3 tokens
    mean, inv_std = whiten_tokens(tokens)
    close(adv, T([[(c - mean) * inv_std] for c in centred]) * mask)
    torch.testing.assert_close(adv, ret)


def test_constant_groups_give_zero_advantage():
    rewards, mask = outcome([0.7] * 4 + [0.1] * 3, [[1, 1, 0]] * 7)
    index = np.array([3, 3, 3, 3, 9, 9, 9])
    for name in ("grpo", "rloo", "opo", "gpg"):
        adv, _ = A.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index)
        assert torch.equal(adv, torch.zeros_like(adv)), name


# ---------------------------------------------------------------- REINFORCE++ / ReMax
def test_reinforce_plus_plus_discounts_and_whitens():
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret = A.compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    close(ret, [[0.125, 0.25, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0]])
    mean, inv_std = whiten_tokens([0.125, 0.25, 0.5, 1.0, 1.0, 2.0])
    close(adv, ((ret - mean) * inv_std) * mask)


def test_reinforce_plus_plus_carries_return_across_a_gap():
    # verl 0.9.1: a masked position neither adds its reward nor discounts; returns are 0 there
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0], [0.0, 5.0, 0.0, 1.0]])
    mask = T([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    adv, ret = A.compute_advantage("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=1.0)
    close(ret, [[1.0, 0.0, 1.0, 1.0], [3.0, 3.0, 3.0, 0.0], [1.0, 0.0, 1.0, 1.0]])  # the 5 in a gap is ignored
    mean, inv_std = whiten_tokens([1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0])
    close(adv, ((ret - mean) * inv_std) * mask)
    _, ret = A.compute_advantage("reinforce_plus_plus", token_level_rewards=rewards[:1], response_mask=mask[:1], gamma=0.5)
    close(ret, [[0.25, 0.0, 0.5, 1.0]])  # discounted once per policy token: the gap does not discount


def test_remax_subtracts_greedy_baseline():
    rewards = T([[0.0, 1.0, 0.0, 2.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])  # the reward at the padded slot is ignored
    adv, ret = A.compute_advantage("remax", token_level_rewards=rewards, response_mask=mask, reward_baselines=T([0.4]))
    close(ret, [[1.0, 1.0, 0.0, 0.0]])
    close(adv, [[0.6, 0.6, -0.4, 0.0]])
    with pytest.raises(ValueError, match="reward_baselines"):
        A.compute_advantage("remax", token_level_rewards=rewards, response_mask=mask)


def test_group_estimators_need_index():
    for name in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="index"):
            A.compute_advantage(name, token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3))


def test_every_estimator_runs_through_the_dispatcher():
    g = torch.Generator().manual_seed(1)
    rewards, mask = outcome(SCORES, MASKS)
    full = dict(
        index=INDEX,
        values=torch.randn(mask.shape, generator=g),
        reward_baselines=torch.rand(6, generator=g),
        old_log_probs=-torch.rand(mask.shape, generator=g),
        sum_pi_squared=torch.rand(mask.shape, generator=g),
    )
    for name in A.ADV_ESTIMATORS:
        if name == "grpo_passk":  # needs two samples in every group (tested below)
            continue
        adv, ret = A.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, **full)
        assert adv.shape == ret.shape == mask.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name


# ---------------------------------------------------------------- vectorised == naive loop
def naive_group(scores: list[float], index, lengths: list[float], kind: str, norm: bool = True) -> list[float]:
    """verl's per-group Python loop, written out independently of engines.algorithms."""
    groups: dict = defaultdict(list)
    for i, k in enumerate(index):
        groups[k].append(i)
    nonzero = sum(1 for s in scores if s != 0)
    alpha = len(scores) / max(1, nonzero)
    out = [0.0] * len(scores)
    for rows in groups.values():
        vals = torch.tensor([scores[i] for i in rows], dtype=torch.float32)
        n = len(rows)
        mean = torch.mean(vals).item() if n > 1 else 0.0
        std = torch.std(vals).item() if n > 1 else 1.0
        for i in rows:
            if kind == "grpo":
                out[i] = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
            elif kind == "rloo":
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1) if n > 1 else scores[i]
            elif kind == "rloo_vectorized":
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1) if n > 1 else 0.0
            elif kind == "opo":
                lens = [lengths[j] for j in rows]
                base = sum(lens[k] * scores[j] for k, j in enumerate(rows)) / sum(lens) if n > 1 else 0.0
                out[i] = scores[i] - base
            elif kind == "gpg":
                out[i] = alpha * (scores[i] - mean)
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "rloo_vectorized", "opo", "gpg", "grpo_vectorized"])
def test_vectorised_group_estimators_equal_naive_loop(kind):
    rng = np.random.default_rng(7)
    sizes = [1, 2, 3, 5, 8, 1, 4]
    index = np.array([f"uid-{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    order = rng.permutation(len(index))  # groups interleaved, as after shuffling
    index = index[order]
    b, width = len(index), 9
    mask = torch.zeros(b, width)
    for i in range(b):
        mask[i, : rng.integers(1, width + 1)] = 1
        mask[i, rng.integers(0, width)] = 0  # punch a gap (or trim)
        mask[i, 0] = 1
    scores = rng.normal(size=b).round(3)
    scores[rng.random(b) < 0.3] = 0.0
    rewards, _ = outcome(scores.tolist(), mask.tolist())
    name = "grpo" if kind == "dr_grpo" else kind
    adv, _ = A.compute_advantage(
        name, token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=kind != "dr_grpo"
    )
    naive = "grpo" if name == "grpo_vectorized" else name  # verl's vectorised GRPO computes GRPO's values
    expected = naive_group(scores.tolist(), index, mask.sum(-1).tolist(), naive, norm=kind != "dr_grpo")
    torch.testing.assert_close(adv, T(expected, dtype=torch.float32).unsqueeze(-1) * mask, atol=1e-4, rtol=1e-4)


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


# ---------------------------------------------------------------- verl parity, part 2: estimators
def test_rloo_vectorized_gives_a_lone_sample_zero():
    rewards, mask = outcome(SCORES, MASKS)
    adv, ret = A.compute_advantage("rloo_vectorized", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    close(adv, T([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]).unsqueeze(-1) * mask)  # rloo keeps 0.5 for group b
    close(ret, adv)


def test_grpo_vectorized_is_grpo():
    rewards, mask = outcome(SCORES, MASKS)
    a, _ = A.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    b, _ = A.compute_advantage("grpo_vectorized", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    assert torch.equal(a, b)


def test_grpo_passk_by_hand():
    scores = [1.0, 0.0, 0.5, 1.0, 1.0, 0.2]
    index = ["a", "a", "a", "c", "c", "d"][:5] + ["a"]  # a: rows 0, 1, 2, 5; c: a tie
    rewards, mask = outcome(scores, MASKS)
    adv, ret = A.compute_advantage("grpo_passk", token_level_rewards=rewards, response_mask=mask, index=index)
    std_a = statistics.stdev([1.0, 0.0, 0.5, 0.2])
    close(adv, T([(1.0 - 0.5) / (std_a + 1e-6), 0, 0, 0, 0, 0]).unsqueeze(-1) * mask)  # only the best learns
    close(ret, adv)
    adv, _ = A.compute_advantage(
        "grpo_passk", token_level_rewards=rewards, response_mask=mask, index=index, norm_adv_by_std_in_grpo=False
    )
    close(adv, T([0.5, 0, 0, 0, 0, 0]).unsqueeze(-1) * mask)
    with pytest.raises(ValueError, match="at least 2 samples"):
        A.compute_advantage("grpo_passk", token_level_rewards=rewards, response_mask=mask, index=INDEX)


def test_gdpo_single_reward_is_whitened_grpo():
    rewards, mask = outcome(SCORES, MASKS)
    adv, ret = A.compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=INDEX)
    std_a = statistics.stdev([1.0, 0.0, 0.0])
    grpo_rows = [(1 - 1 / 3) / (std_a + 1e-6), -1 / 3 / (std_a + 1e-6), -1 / 3 / (std_a + 1e-6), 0.5 / 1.000001, 0, 0]
    tokens = [g for g, m in zip(grpo_rows, MASKS, strict=True) for _ in range(int(sum(m)))]
    mean, inv_std = whiten_tokens(tokens)
    close(adv, ((T(grpo_rows).unsqueeze(-1) - mean) * inv_std) * mask)
    close(ret, adv)


def test_optimal_token_baseline_by_hand():
    rewards = T([[0.0, 1.0], [0.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    old = T([[0.5, 0.5], [0.2, 0.2]]).log()
    s2 = T([[0.5, 0.5], [0.3, 0.3]])
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=["g", "g"], old_log_probs=old, sum_pi_squared=s2)
    adv, ret = A.compute_advantage("optimal_token_baseline", **kw)
    # w = 1 - 2 pi + sum pi^2: row 0 0.5 per step (W = 0.5, 1.0), row 1 0.9 (W = 0.9); G0 = (1, 1), G1 = (0, 0)
    b0 = (1 * 0.5 + 0 * 0.9) / (0.5 + 0.9 + 1e-8)
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    # column 1: row 0 is the group's only longer response -> baseline 0 there (handle_zero_tail)
    close(adv, [[1 - b0, 1.0], [0 - b0, 0.0]])
    w = T([[2.0, 1.0], [1.0, 1.0]])  # rollout IS weights scale w by rho^2
    adv, _ = A.compute_advantage("optimal_token_baseline", rollout_is_weights=w, **kw)
    b0 = (1 * 0.5 * 4) / (0.5 * 4 + 0.9 + 1e-8)
    close(adv[:, 0], [1 - b0, -b0])
    # a one-member group has no baseline: advantage = return
    adv, _ = A.compute_advantage("optimal_token_baseline", **{**kw, "index": ["g", "h"]})
    close(adv, [[1.0, 1.0], [0.0, 0.0]])


def test_tir_optimal_token_baseline_aligns_policy_tokens_across_gaps():
    rewards = T([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    mask = T([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # row 0: a tool-output gap of two tokens
    old = torch.full((2, 4), 0.5).log()
    s2 = torch.full((2, 4), 0.5)  # w = 0.5 everywhere: W at policy step k is 0.5 * (k + 1) in both rows
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=["g", "g"], old_log_probs=old, sum_pi_squared=s2)
    adv, ret = A.compute_advantage("tir_optimal_token_baseline", **kw)
    close(ret, [[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    # packed steps: row 0 G = (1, 1), row 1 G = (2, 2), equal weights -> B = (1.5, 1.5)
    close(adv, [[-0.5, 0.0, 0.0, -0.5], [0.5, 0.5, 0.0, 0.0]])
    # the column-wise OTB compares row 0's tool-turn tokens with row 1's instead
    col, _ = A.compute_advantage("optimal_token_baseline", **kw)
    assert not torch.allclose(col, adv)
    # without gaps the two agree
    full = T([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a, _ = A.compute_advantage("tir_optimal_token_baseline", **{**kw, "response_mask": full})
    b, _ = A.compute_advantage("optimal_token_baseline", **{**kw, "response_mask": full})
    close(a, b)


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


# ---------------------------------------------------------------- rollout correction
def test_rollout_correction_token_sequence_icepop_and_normalisation():
    rollout = torch.zeros(2, 3)
    d = T([[math.log(3.0), math.log(0.5), 0.0], [math.log(1.5), math.log(0.2), 7.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # a garbage 7.0 sits in a masked slot
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    close(w, [[2.0, 0.5, 1.0], [1.5, 0.2, 0.0]])  # TIS: truncated at 2, 0 where masked
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 5)
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 1 / 5)  # 0.2 < 1/2
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold="0.4_2.5")
    close(w, [[0.0, 0.5, 1.0], [1.5, 0.0, 0.0]])  # IcePop: outside [0.4, 2.5] -> 0, inside unchanged
    close(m["rollout_corr/rollout_is_oob_ratio"], 2 / 5)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    close(w, [[1.5, 1.5, 1.5], [0.3, 0.3, 0.0]])  # row products 1.5 and 0.3
    close(m["rollout_corr/rollout_is_max"], 1.5)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    mean = (2.0 + 0.5 + 1.0 + 1.5 + 0.2) / 5
    close(w, T([[2.0, 0.5, 1.0], [1.5, 0.2, 0.0]]) / mean)
    close(m["rollout_corr/rollout_is_batch_norm_factor"], mean)
    w, m = A.rollout_correction(d, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    close(w, T([[1.5, 1.5, 1.5], [0.3, 0.3, 0.0]]) / 0.9)  # mean over rows, not tokens
    # the off-policy diagnostics
    close(m["rollout_corr/kl"], -(math.log(3.0) + math.log(0.5) + math.log(1.5) + math.log(0.2)) / 5)
    close(m["rollout_corr/chi2_token"], (9.0 + 0.25 + 1.0 + 2.25 + 0.04) / 5 - 1)
    none, m = A.rollout_correction(d, rollout, mask, rollout_is=None)
    assert none is None and "rollout_corr/k3_kl" in m


def test_config_refuses_bad_settings_in_one_line():
    from rlstage.engines.preflight import check_registered_names
    from rlstage.schemas.config import ConfigError, load_config

    def load(overrides):  # the CLI's loading: the model, then the names and needs against the registries
        check_registered_names(cfg := load_config(None, overrides))
        return cfg

    bad = {
        "rollout_is_threshold": (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold='2_0.5'"], "IcePop band needs low < high"),
        "passk": (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "needs groups of n >= 2"),
        "dro": (["actor.policy_loss=dro"], r"actor\.policy_loss\.dro_beta: Field required"),
        "otb": (["algorithm.adv_estimator=optimal_token_baseline"], "set actor.calculate_sum_pi_squared=true"),
        "bypass": (["actor.policy_loss=bypass_mode"], "bypass_mode=true"),
        "bypass_other": (["algorithm.rollout_correction.bypass_mode=true", "actor.policy_loss=gspo"], "leave actor.policy_loss"),
        "actor_copy": (["actor.rollout_correction.rollout_is=token"], "set it there"),
        "rs": (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs"),
    }
    for key, (overrides, match) in bad.items():
        with pytest.raises(ConfigError, match=match) as err:
            load(overrides)
        assert "\n" not in str(err.value), key
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold='0.5_2'"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"
    assert cfg.actor.rollout_correction == cfg.algorithm.rollout_correction
    assert cfg.actor.rollout_correction.enabled


# ---------------------------------------------------------------- DAPO overlong reward shaping
def test_overlong_penalty_by_hand():
    # limit 8, buffer 4: no penalty up to 4 tokens, then -0.5 per token over 4 (factor 2), -2 at the limit
    assert A.overlong_penalty([3, 4, 5, 6, 8], 8, 4, 2.0) == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0])
    with pytest.raises(ValueError, match="overlong buffer"):
        A.overlong_penalty([1], 8, 0, 1.0)


def test_overlong_buffer_config():
    from rlstage.schemas.config import ConfigError, load_config

    cfg = load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4", "rollout.max_new_tokens=8"])
    assert cfg.max_response_tokens == 8 and cfg.reward.overlong_buffer.penalty_factor == 1.0
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer\.len=9 must be > 0 and at most rollout\.max_new_tokens=8"):
        load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9", "rollout.max_new_tokens=8"])


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_micro_batches_with_the_global_counts_sum_to_the_whole_batch(mode, dp_size):
    """The trainer's reduction is agg_loss itself: each micro-batch (of each rank) with the mini-batch's global
    counts (AggNorm, verl's global_batch_info), summed over micro-batches and averaged over ranks, equals
    agg_loss of the whole mini-batch on one process (seq-mean-token-sum-norm divides by its longest response)."""
    g = torch.Generator().manual_seed(7)
    lens = [5, 3, 0, 4, 1, 5, 2, 3]
    width = max(lens)
    loss = torch.randn(len(lens), width, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lens])
    norm = A.agg_norm([row[:n].tolist() for row, n in zip(mask, lens, strict=True)], dp_size=dp_size)
    whole = A.agg_loss(loss, mask, mode, loss_scale_factor=width)
    ranks = [list(range(r, len(lens), dp_size)) for r in range(dp_size)]  # each rank's slice of the mini-batch
    per_rank = []
    for rows in ranks:
        micro = [rows[i : i + 2] for i in range(0, len(rows), 2)]
        # each micro-batch padded only to its own longest response, as the trainer pads it
        parts = []
        for m in micro:
            w = max(max(lens[i] for i in m), 1)
            parts.append(A.agg_loss(loss[m, :w], mask[m, :w], mode, **norm.agg_kwargs()))
        per_rank.append(sum(parts))
    assert float(sum(per_rank) / dp_size) == pytest.approx(float(whole), rel=1e-5, abs=1e-6)


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


def test_the_trainer_hands_actor_loss_scale_factor_to_agg_loss():
    """With ``actor.loss_scale_factor`` set, every micro-batch of the actor's update carries the constant in its global
    counts (the fixed-count form would divide each micro-batch by its own width); unset, it keeps verl's fixed-count
    scaling bit for bit."""
    from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
    from rlstage.engines.training.actor import TorchActor
    from rlstage.schemas.config import ActorConfig, KitConfig

    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
    batch = {"prompt_ids": [[5, 6]] * 4, "response_ids": [[7], [7, 8], [7, 8, 9], [7]], "response_mask": [[1], [1, 1], [1, 1, 1], [1]]}
    base = {"ppo_mini_batch_size": 4, "micro_batch_size": 2, "loss_agg_mode": "seq-mean-token-sum-norm"}
    fixed = TorchActor(model, ActorConfig(**base), tok.pad_token_id, 1)._micro_batches(batch, [0, 1, 2, 3], [0, 1, 2, 3])
    assert [m.norm for m in fixed] == [None, None]
    const = TorchActor(model, ActorConfig(**base, loss_scale_factor=32), tok.pad_token_id, 1)
    micro = const._micro_batches(batch, [0, 1, 2, 3], [0, 1, 2, 3])
    assert [m.norm.agg_kwargs()["loss_scale_factor"] for m in micro] == [32, 32]


def test_a_loss_declares_its_fixed_aggregation_and_its_keyword_defaults_are_its_settings_models():
    import inspect

    assert A.fixed_pg_agg("sapo") == "seq-mean-token-mean" and A.fixed_pg_agg("geo_mean") == "row-mean"
    assert A.fixed_pg_agg("vanilla") is None
    for name, fn in A.POLICY_LOSSES.items():  # a built-in loss's keyword default never disagrees with its settings
        model = A.POLICY_LOSSES.entry(name).settings
        params = inspect.signature(fn).parameters
        for setting, info in (model.model_fields.items() if model else ()):
            if setting in params and not info.is_required() and params[setting].default is not inspect.Parameter.empty:
                assert params[setting].default == info.default, (name, setting)
