"""engines/algorithms/advantages.py: GAE, the group estimators, REINFORCE++ and ReMax by hand and against verl's
conventions, vectorised against a naive loop, and DAPO's overlong reward shaping."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest
import torch

from rlstage.engines import algorithms as A
from tests_support import INDEX, MASKS, SCORES, T, close, outcome, whiten_tokens


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
