"""Micro-batching: packed vs padded inputs, token-budget planning, exact gradient accumulation."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import LlamaForTokenClassification

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    micro_batch_cost,
    plan_micro_batches,
    split_to_count,
)
from rlstage.engines.training.critic import TorchCritic, response_values
from rlstage.engines.training.forward import build_inputs, build_packed_inputs, response_log_probs
from rlstage.schemas.config import (
    ActorConfig,
    ConfigError,
    CriticConfig,
    KitConfig,
    ModelConfig,
    OptimConfig,
    RolloutCorrectionConfig,
    load_config,
)

KIT = KitConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(1)
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def weights(tok):
    torch.manual_seed(0)
    return {k: v.clone() for k, v in build_tiny_llama(KIT, tok).state_dict().items()}


def new_model(tok, weights, attn: str = "sdpa"):
    model = build_tiny_llama(KIT, tok)
    model.load_state_dict(weights)
    model.config._attn_implementation = attn
    return model


def make_batch(tok, n: int, seed: int = 0) -> dict[str, list]:
    """Ragged prompts (1-12) and responses (0-10 tokens, one empty), masked tokens, a fully masked row."""
    rng = random.Random(seed)
    vocab = len(tok)
    keys = ("prompt_ids", "response_ids", "response_mask", "old_log_probs", "advantages", "ref_log_probs")
    batch: dict[str, list] = {k: [] for k in keys}
    batch.update(values=[], returns=[])
    for i in range(n):
        p = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))]
        r = [] if i == 5 else [rng.randrange(4, vocab) for _ in range(rng.randint(1, 10))]
        mask = [1] * len(r)
        if i % 4 == 1 and len(r) > 1:
            mask[-1] = 0
        if i == 2:
            mask = [0] * len(r)  # a row with no policy token: excluded from the seq-mean counts
        batch["prompt_ids"].append(p)
        batch["response_ids"].append(r)
        batch["response_mask"].append(mask)
        batch["advantages"].append([rng.uniform(-1.5, 1.5)] * len(r))
        batch["old_log_probs"].append([-4.6 + rng.uniform(-0.6, 0.6) for _ in r])
        batch["ref_log_probs"].append([-4.6 + rng.uniform(-0.3, 0.3) for _ in r])
        batch["values"].append([rng.uniform(-1, 1) for _ in r])
        batch["returns"].append([rng.uniform(-1, 1) for _ in r])
    return batch



# ---------------------------------------------------------------- the output layer
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_output_layer_runs_on_response_positions_only(tok, weights, packed):
    """``response_logits`` asks the model for the logits of the positions that predict response tokens alone;
    they equal the same columns of a full forward, also through peft, and a critic's token classifier (which has
    no ``logits_to_keep``) keeps its full forward."""
    from rlstage.engines.models.lora import with_adapters
    from rlstage.engines.training.forward import response_logits, takes_logits_to_keep

    model = new_model(tok, weights).eval()
    batch = make_batch(tok, 9)
    P, R = batch["prompt_ids"], batch["response_ids"]
    inputs = build_packed_inputs(P, R) if packed else build_inputs(P, R, tok.pad_token_id)
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad():
        got = response_logits(model, inputs)
        hook.remove()
        full = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                     position_ids=inputs["position_ids"], use_cache=False).logits  # fmt: skip
    if packed:
        want = full[0, inputs["logit_index"]]
        assert seen == [len(set(inputs["logit_index"].flatten().tolist()))]
    else:
        w = inputs["prompt_width"]
        want = full[:, w - 1 : w + inputs["response_width"] - 1]
        assert seen == [inputs["response_width"] + 1]
    assert seen[0] < full.shape[1]  # fewer positions than the whole row
    for i, r in enumerate(R):
        torch.testing.assert_close(got[i, : len(r)], want[i, : len(r)], atol=1e-5, rtol=0)
    assert takes_logits_to_keep(with_adapters(new_model(tok, weights), ModelConfig(lora_rank=4)))
    assert not takes_logits_to_keep(LlamaForTokenClassification(model.config))


def test_the_entropy_is_differentiated_only_when_asked(tok, weights):
    model = new_model(tok, weights)
    batch = make_batch(tok, 4)
    inputs = build_inputs(batch["prompt_ids"], batch["response_ids"], tok.pad_token_id)
    logp, ent = response_log_probs(model, inputs, 1.0, with_entropy=True, entropy_grad=False)
    assert logp.requires_grad and not ent.requires_grad
    _, ent2 = response_log_probs(model, inputs, 1.0, with_entropy=True)
    assert ent2.requires_grad
    torch.testing.assert_close(ent, ent2.detach(), atol=0, rtol=0)

# ---------------------------------------------------------------- packing
@pytest.mark.invariant("packed == padded", "log-probs and entropy within 1e-5")
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_equal_padded(tok, weights, attn):
    model = new_model(tok, weights, attn).eval()
    batch = make_batch(tok, 9)
    P, R = batch["prompt_ids"], batch["response_ids"]
    with torch.no_grad():
        padded, pad_ent = response_log_probs(model, build_inputs(P, R, tok.pad_token_id), 0.7, with_entropy=True)
        packed_in = build_packed_inputs(P, R)
        packed, pack_ent = response_log_probs(model, packed_in, 0.7, with_entropy=True)
    assert packed_in["input_ids"].shape == (1, sum(len(p) + len(r) for p, r in zip(P, R, strict=True)))
    for i, r in enumerate(R):
        torch.testing.assert_close(packed[i, : len(r)], padded[i, : len(r)], atol=1e-5, rtol=0)
        torch.testing.assert_close(pack_ent[i, : len(r)], pad_ent[i, : len(r)], atol=1e-5, rtol=0)
    # The check can fail: one row with continuous position ids lets tokens attend across sequences.
    leaky = dict(packed_in, position_ids=torch.arange(packed_in["input_ids"].shape[1])[None])
    with torch.no_grad():
        crossed, _ = response_log_probs(model, leaky, 0.7)
    assert max((crossed[i, : len(r)] - padded[i, : len(r)]).abs().max().item() for i, r in enumerate(R) if r) > 1e-3


def test_packed_values_and_actor_passes_equal_padded(tok, weights):
    batch = make_batch(tok, 9, seed=1)
    P, R = batch["prompt_ids"], batch["response_ids"]
    base = new_model(tok, weights)
    critic_model = LlamaForTokenClassification(base.config.__class__(**{**base.config.to_dict(), "num_labels": 1}))
    critic_model.model.load_state_dict(base.model.state_dict())
    critic_model.eval()
    with torch.no_grad():
        padded = response_values(critic_model, build_inputs(P, R, tok.pad_token_id))
        packed = response_values(critic_model, build_packed_inputs(P, R))
    for i, r in enumerate(R):
        torch.testing.assert_close(packed[i, : len(r)], padded[i, : len(r)], atol=1e-5, rtol=0)
    # Through the engines' no-grad passes, with token budgets (outputs in the input order).
    for packing, budget in ((True, 40), (True, None), (False, 40)):
        cfg = ActorConfig(micro_batch_size=2, ppo_mini_batch_size=2, packing=packing, micro_batch_tokens=budget)
        got = TorchActor(base, cfg, tok.pad_token_id, 10).compute_log_probs(P, R, 1.0)
        ccfg = CriticConfig(micro_batch_size=2, ppo_mini_batch_size=2, packing=packing, micro_batch_tokens=budget)
        vals = TorchCritic(critic_model, ccfg, tok.pad_token_id, 10).compute_values(P, R)
        want = TorchActor(base, ActorConfig(), tok.pad_token_id, 10).compute_log_probs(P, R, 1.0)
        want_v = TorchCritic(critic_model, CriticConfig(), tok.pad_token_id, 10).compute_values(P, R)
        for g, w in ((got, want), (vals, want_v)):
            assert [len(x) for x in g] == [len(r) for r in R]
            assert max((abs(a - b) for gi, wi in zip(g, w, strict=True) for a, b in zip(gi, wi, strict=True))) < 1e-5


def test_sum_pi_squared_is_the_softmax_squared_at_the_temperature_in_every_batching(tok, weights):
    """verl's calculate_sum_pi_squared (optimal_token_baseline's input): sum over the vocabulary of pi^2 at the
    sampling temperature, computed in log space; the engine pass gives it with the same log-probs, padded,
    packed or by token budget."""
    from rlstage.engines.training.forward import response_logits

    model = new_model(tok, weights).eval()
    batch = make_batch(tok, 9, seed=3)
    P, R = batch["prompt_ids"], batch["response_ids"]
    inputs = build_inputs(P, R, tok.pad_token_id)
    with torch.no_grad():
        pi = torch.softmax(response_logits(model, inputs).float() / 0.7, dim=-1)
        logp, s2 = response_log_probs(model, inputs, 0.7, with_sum_pi_squared=True)
    torch.testing.assert_close(s2, (pi * pi).sum(-1), atol=1e-6, rtol=1e-5)
    assert bool(((s2 > 0) & (s2 <= 1 + 1e-6)).all())
    hotter = response_log_probs(model, inputs, 2.0, with_sum_pi_squared=True)[1]
    assert bool((hotter < s2).all())  # a flatter distribution: less mass in its squares
    want_lp = TorchActor(model, ActorConfig(), tok.pad_token_id, 10).compute_log_probs(P, R, 0.7)
    for packing, budget in ((False, None), (True, 40), (False, 40)):
        cfg = ActorConfig(micro_batch_size=2, ppo_mini_batch_size=2, packing=packing, micro_batch_tokens=budget)
        lp, sq = TorchActor(model, cfg, tok.pad_token_id, 10).compute_log_probs_and_sum_pi_squared(P, R, 0.7)
        for i, r in enumerate(R):
            assert lp[i] == pytest.approx(want_lp[i], abs=1e-5)
            assert sq[i] == pytest.approx(s2[i, : len(r)].tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="one per-token statistic"):
        response_log_probs(model, inputs, 0.7, with_entropy=True, with_sum_pi_squared=True)


def test_packing_refuses_an_unknown_attention_implementation(tok, weights):
    model = new_model(tok, weights)
    model.config._attn_implementation = "paged_attention"
    with pytest.raises(ValueError, match="packing needs one of"):
        TorchActor(model, ActorConfig(packing=True), tok.pad_token_id, 10)


# ---------------------------------------------------------------- planning
def test_token_budget_plans_cover_every_sample_within_budget(tok):
    batch = make_batch(tok, 30, seed=2)
    P, R = batch["prompt_ids"], batch["response_ids"]
    ids = list(range(30))
    random.Random(0).shuffle(ids)
    for packed in (True, False):
        plans = plan_micro_batches(ids, P, R, count=4, budget=45, packed=packed, setting="actor.micro_batch_tokens")
        assert sorted(i for p in plans for i in p) == sorted(ids)
        costs = [micro_batch_cost([len(P[i]) for i in p], [len(R[i]) for i in p], packed) for p in plans]
        assert max(costs) <= 45
        assert len(plans) > 2  # really split
        if packed:  # order kept
            assert [i for p in plans for i in p] == ids
    # Without a budget: fixed counts in the given order (the default path).
    assert plan_micro_batches(ids, P, R, count=7, budget=None, packed=False, setting="x") == [
        ids[u : u + 7] for u in range(0, 30, 7)
    ]


def test_token_budget_cuts_process_the_fewest_padded_tokens():
    """Padded micro-batches under a budget: the cuts of the length-sorted samples that process the fewest tokens
    (plus a fixed cost each), found exactly; filling each micro-batch in turn would pad short rows to long ones."""
    P = [[1] * 10 for _ in range(7)]
    R = [[2] * 90] * 3 + [[3] * 20] * 4  # 3 sequences of 100 tokens, 4 of 30
    plans = plan_micro_batches(range(7), P, R, count=7, budget=400, packed=False, setting="x")
    assert sorted(map(sorted, plans)) == [[0, 1, 2], [3, 4, 5, 6]]  # 300 + 120 tokens; greedy took 400 + 90
    # Against every way to cut the sorted samples (random lengths, both layouts): never more than the cheapest.
    rng = random.Random(0)
    for shared in (False, True):
        for _ in range(20):
            n = 8
            prompts = [[rng.randrange(1, 4)] * rng.randrange(3, 12) for _ in range(3)]
            P = [prompts[rng.randrange(3)] for _ in range(n)]
            R = [[5] * rng.randrange(1, 30) for _ in range(n)]
            budget = 80

            def cost(plan: list[int], P=P, R=R, shared=shared) -> int:
                distinct = len({tuple(P[i]) for i in plan}) if shared else None
                return micro_batch_cost([len(P[i]) for i in plan], [len(R[i]) for i in plan], False, distinct)

            plans = plan_micro_batches(range(n), P, R, count=n, budget=budget, packed=False, setting="x", shared=shared)
            assert sorted(i for p in plans for i in p) == list(range(n))
            assert all(cost(p) <= budget for p in plans)
            got = sum(cost(p) + MICRO_BATCH_OVERHEAD_TOKENS for p in plans)
            orders = [sorted(range(n), key=lambda i: len(P[i]) + len(R[i]), reverse=True)]
            if shared:
                first = {tuple(p): i for i, p in reversed(list(enumerate(P)))}
                orders = [
                    sorted(range(n), key=lambda i: (-len(P[i]), first[tuple(P[i])], -len(R[i]))),
                    sorted(range(n), key=lambda i: (-len(R[i]), -len(P[i]))),
                ]
            best = math.inf
            for order in orders:
                for mask in range(1 << (n - 1)):
                    cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
                    parts = [order[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
                    if all(cost(p) <= budget for p in parts):
                        best = min(best, sum(cost(p) + MICRO_BATCH_OVERHEAD_TOKENS for p in parts))
            assert got == best


def test_budget_smaller_than_one_sequence_is_a_clear_error(tok, weights):
    batch = make_batch(tok, 6)
    longest = max(len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"], strict=True))
    with pytest.raises(ValueError, match=rf"actor\.micro_batch_tokens={longest - 1} is smaller than one sequence"):
        plan_micro_batches(
            range(6), batch["prompt_ids"], batch["response_ids"], count=2, budget=longest - 1, packed=True,
            setting="actor.micro_batch_tokens",
        )
    actor = TorchActor(
        new_model(tok, weights), ActorConfig(ppo_mini_batch_size=6, micro_batch_tokens=longest - 1), tok.pad_token_id, 10
    )
    with pytest.raises(ValueError, match=r"raise actor\.micro_batch_tokens to at least"):
        actor.update(batch, 1.0, 0)
    critic = TorchCritic(new_model(tok, weights), CriticConfig(micro_batch_tokens=3), tok.pad_token_id, 10)
    with pytest.raises(ValueError, match=r"critic\.micro_batch_tokens=3"):
        critic.compute_values(batch["prompt_ids"], batch["response_ids"])
    # At config load, against the longest sequence the run can produce.
    with pytest.raises(ConfigError, match=r"actor\.micro_batch_tokens=100 is smaller than the longest sequence"):
        load_config(None, ["actor.micro_batch_tokens=100", "data.max_prompt_length=96", "rollout.max_new_tokens=8"])
    with pytest.raises(ConfigError, match=r"critic\.micro_batch_tokens=10"):
        load_config(
            None,
            ["critic.enable=true", "algorithm.adv_estimator=gae", "critic.micro_batch_tokens=10", "data.max_prompt_length=8"],
        )
    cfg = load_config(None, ["actor.micro_batch_tokens=104", "data.max_prompt_length=96", "rollout.max_new_tokens=8"])
    assert cfg.actor.micro_batch_tokens == 104


# ---------------------------------------------------------------- exact accumulation
class GradRecordingActor(TorchActor):
    """A TorchActor that keeps a copy of the accumulated gradient of every optimizer step."""

    def _optimizer_step(self) -> float:
        self.grads = getattr(self, "grads", [])
        self.grads.append(torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]))
        return super()._optimizer_step()


class GradRecordingCritic(TorchCritic):
    def _optimizer_step(self) -> float:
        self.grads = getattr(self, "grads", [])
        self.grads.append(torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]))
        return super()._optimizer_step()


def actor_cfg(mode: str, **kw) -> ActorConfig:
    base = dict(
        ppo_mini_batch_size=6,
        micro_batch_size=6,  # the reference: each mini-batch as one batch
        ppo_epochs=2,
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        optim=OptimConfig(lr=5e-3, warmup_steps=1, lr_schedule="cosine", grad_clip=0.5),
    )
    base.update(kw)
    return ActorConfig(**base)


def run_actor(tok, weights, cfg: ActorConfig, batch: dict):
    model = new_model(tok, weights)
    actor = GradRecordingActor(model, cfg, tok.pad_token_id, 20)
    metrics = actor.update(batch, 0.9, 5)
    return metrics, actor.grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_update(got, want, grad_atol: float = 2e-6) -> None:
    """Every step's accumulated gradient, the final parameters and the metrics agree."""
    (gm, gg, gp), (wm, wg, wp) = got, want
    assert len(gg) == len(wg)
    for a, b in zip(gg, wg, strict=True):
        torch.testing.assert_close(a, b, atol=grad_atol, rtol=1e-5)
    for k in wp:
        # Adam divides by sqrt(v): near-zero gradient entries turn float noise into up to ~lr/100 here.
        torch.testing.assert_close(gp[k], wp[k], atol=5e-5, rtol=0)
    assert set(gm) == set(wm)
    for k in wm:
        assert gm[k] == pytest.approx(wm[k], rel=1e-5, abs=1e-6), k


@pytest.mark.invariant("micro-batches accumulated == one micro-batch", "every step's gradient within 2e-6 + 1e-5 relative, weights within 5e-5, metrics within 1e-5 relative (padded and packed)")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_token_budget_accumulation_equals_one_batch(tok, weights, mode, packing):
    batch = make_batch(tok, 12, seed=3)
    want = run_actor(tok, weights, actor_cfg(mode), batch)
    assert want[0]["actor/grad_norm"] > 0.5  # clipping is active, so the gradient scale matters
    cfg = actor_cfg(mode, micro_batch_tokens=30, packing=packing)
    plans = plan_micro_batches(
        range(6), batch["prompt_ids"], batch["response_ids"], count=6, budget=30, packed=packing, setting="x"
    )
    assert len(plans) >= 3  # several micro-batches per mini-batch
    assert_same_update(run_actor(tok, weights, cfg, batch), want)


@pytest.mark.parametrize("loss", ["sapo", "geo_mean"])
def test_fixed_aggregation_losses_are_weighted_as_their_own(tok, weights, loss):
    """sapo (seq-mean-token-mean) and geo_mean (mean over all rows) ignore loss_agg_mode; so must their weights."""
    batch = make_batch(tok, 12, seed=4)
    want = run_actor(tok, weights, actor_cfg("token-mean", policy_loss=loss), batch)
    got = run_actor(tok, weights, actor_cfg("token-mean", policy_loss=loss, micro_batch_tokens=30), batch)
    assert_same_update(got, want)


@pytest.mark.invariant("micro-batches accumulated == one micro-batch", "token-sum: six micro-batches of one sample, three of two, one of six; every step's gradient within 1e-5 + 1e-5 relative, weights within 5e-5")
@pytest.mark.parametrize("micro", [1, 2])
def test_token_sum_accumulates_exactly_without_a_budget(tok, weights, micro):
    """token-sum has no len(micro)/len(mini) form: fixed-count micro-batches are weighted exactly too."""
    batch = make_batch(tok, 12, seed=4)
    want = run_actor(tok, weights, actor_cfg("token-sum"), batch)
    # a sum over ~30 tokens: gradients ~30x a mean's, float noise with them
    assert_same_update(run_actor(tok, weights, actor_cfg("token-sum", micro_batch_size=micro), batch), want, grad_atol=1e-5)


# ---------------------------------------------------------------- data parallel: global normalisation
@pytest.mark.invariant("data-parallel world 2 == world 1", "the two ranks' averaged gradient within 2e-6 + 1e-5 relative of one rank's")
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("budget", [None, 30], ids=["count", "budget"])
def test_data_parallel_ranks_give_the_one_rank_gradient(tok, weights, mode, budget):
    """Two ranks simulated in this process, each given the whole batch: each trains its half of the mini-batch
    with weights against the GLOBAL counts times 2, and their averaged gradient is the one-rank gradient."""
    batch = make_batch(tok, 12, seed=6)
    cfg = actor_cfg(mode, ppo_mini_batch_size=12, micro_batch_size=2, micro_batch_tokens=budget, ppo_epochs=1, shuffle=False)
    want = run_actor(tok, weights, cfg, batch)
    grads = []
    for r in range(2):
        rank = GradRecordingActor(new_model(tok, weights), cfg, tok.pad_token_id, 20)
        rank.dp_rank, rank.dp_size = r, 2
        rank.update(batch, 0.9, 5)
        grads.append(rank.grads[0])
    # Data parallelism averages the ranks' gradients: with global counts x dp_size that is the one-rank gradient.
    torch.testing.assert_close((grads[0] + grads[1]) / 2, want[1][0], atol=2e-6, rtol=1e-5)
    if budget is None:
        return
    # Local counts would not do: each half normalised by its own tokens/sequences.
    local = []
    for half in (slice(0, 6), slice(6, 12)):
        rank = GradRecordingActor(new_model(tok, weights), actor_cfg(mode, ppo_mini_batch_size=6, micro_batch_size=2, micro_batch_tokens=budget, ppo_epochs=1, shuffle=False), tok.pad_token_id, 20)
        rank.update({k: v[half] for k, v in batch.items()}, 0.9, 5)
        local.append(rank.grads[0])
    assert ((local[0] + local[1]) / 2 - want[1][0]).abs().max() > 1e-4


def test_decoupled_rollout_is_weights_scale_the_policy_gradient(tok, weights):
    """Rollout log-probs log(2) below the old ones: token TIS weights min(2, 1.5) = 1.5 on every token."""
    batch = make_batch(tok, 12, seed=7)
    batch["rollout_log_probs"] = [[x - math.log(2.0) for x in row] for row in batch["old_log_probs"]]
    kw = dict(entropy_coeff=0.0, use_kl_loss=False, ppo_epochs=1, shuffle=False)
    want = run_actor(tok, weights, actor_cfg("token-mean", **kw), batch)
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5)
    metrics, grads, _ = run_actor(tok, weights, actor_cfg("token-mean", rollout_correction=rc, **kw), batch)
    torch.testing.assert_close(grads[0], 1.5 * want[1][0], atol=2e-6, rtol=1e-5)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1.0)


def test_bypass_mode_trains_against_the_rollout_log_probs(tok, weights):
    """bypass ppo_clip = vanilla PPO with the rollout's log-probs as the old policy."""
    batch = make_batch(tok, 12, seed=8)
    batch["rollout_log_probs"] = [[x + 0.05 for x in row] for row in batch["old_log_probs"]]
    swapped = {**batch, "old_log_probs": batch["rollout_log_probs"]}
    want = run_actor(tok, weights, actor_cfg("token-mean"), swapped)
    rc = RolloutCorrectionConfig(bypass_mode=True, rollout_is="token")
    metrics, grads, _ = run_actor(tok, weights, actor_cfg("token-mean", rollout_correction=rc), batch)
    for a, b in zip(grads, want[1], strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    assert "rollout_corr/rollout_is_mean" in metrics and "actor/pg_clipfrac" in metrics


def test_fixed_count_micro_batches_are_not_exact(tok, weights):
    """Why the token-budget weighting exists: verl's len(micro)/len(mini) scaling differs for token-mean."""
    batch = make_batch(tok, 12, seed=3)
    want = run_actor(tok, weights, actor_cfg("token-mean"), batch)
    _, grads, _ = run_actor(tok, weights, actor_cfg("token-mean", micro_batch_size=2), batch)
    assert (grads[0] - want[1][0]).abs().max().item() > 1e-4


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_critic_token_budget_accumulation_equals_one_batch(tok, weights, mode):
    batch = make_batch(tok, 12, seed=5)
    base = new_model(tok, weights)
    # No dropout in the value head (HF's token-classification default is 0.1): runs must be comparable.
    config = base.config.__class__(**{**base.config.to_dict(), "num_labels": 1, "classifier_dropout": 0.0})
    torch.manual_seed(1)
    init = {k: v.clone() for k, v in LlamaForTokenClassification(config).state_dict().items()}

    def run(**kw):
        model = LlamaForTokenClassification(config)
        model.load_state_dict(init)
        cfg = CriticConfig(ppo_mini_batch_size=6, micro_batch_size=6, ppo_epochs=2, loss_agg_mode=mode, **kw)
        critic = GradRecordingCritic(model, cfg, tok.pad_token_id, 20)
        metrics = critic.update(batch, 3)
        return metrics, critic.grads, {k: v.detach().clone() for k, v in model.state_dict().items()}

    want = run()
    assert_same_update(run(micro_batch_tokens=30, packing=True), want)
    assert_same_update(run(micro_batch_tokens=30), want)


# ---------------------------------------------------------------- shared prompts
def grouped_batch(tok, n: int, per_prompt: int, seed: int) -> dict[str, list]:
    """``make_batch`` whose samples come ``per_prompt`` to a prompt, as GRPO's groups do."""
    batch = make_batch(tok, n, seed=seed)
    batch["prompt_ids"] = [batch["prompt_ids"][i - i % per_prompt] for i in range(n)]
    return batch


@pytest.mark.invariant("shared prompt prefixes == separate prompts", "log-probs and entropy within 1e-5")
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_shared_prompt_log_probs_equal_padded(tok, weights, training):
    from rlstage.engines.training.forward import build_shared_inputs

    model = new_model(tok, weights).train(training)
    batch = grouped_batch(tok, 9, 3, seed=1)
    P, R = batch["prompt_ids"], batch["response_ids"]
    shared = build_shared_inputs(P, R, tok.pad_token_id)
    assert shared["prompt_ids"].shape[0] == 3 and shared["group"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with torch.no_grad():
        padded, pad_ent = response_log_probs(model, build_inputs(P, R, tok.pad_token_id), 0.7, with_entropy=True)
        got, ent = response_log_probs(model, shared, 0.7, with_entropy=True)
    for i, r in enumerate(R):
        torch.testing.assert_close(got[i, : len(r)], padded[i, : len(r)], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, : len(r)], pad_ent[i, : len(r)], atol=1e-5, rtol=0)


@pytest.mark.invariant("shared prompt prefixes == separate prompts", "every step's gradient within 2e-6 + 1e-5 relative, weights within 5e-5")
@pytest.mark.parametrize("budget", [None, 40], ids=["one-micro-batch", "token-budget"])
def test_shared_prompt_updates_equal_padded(tok, weights, budget):
    """The gradient reaches each prompt through its shared cache: every step's gradient and the final weights
    equal the padded layout's (per micro-batch a prompt runs once, so a budget holds more samples)."""
    batch = grouped_batch(tok, 12, 4, seed=3)
    want = run_actor(tok, weights, actor_cfg("seq-mean-token-mean"), batch)
    assert want[0]["actor/grad_norm"] > 0.5  # clipping is active, so the gradient scale matters
    cfg = actor_cfg("seq-mean-token-mean", share_prompts=True, micro_batch_tokens=budget)
    if budget is not None:
        P, R = batch["prompt_ids"], batch["response_ids"]
        shared = plan_micro_batches(range(12), P, R, count=6, budget=budget, packed=False, setting="x", shared=True)
        plain = plan_micro_batches(range(12), P, R, count=6, budget=budget, packed=False, setting="x")
        assert len(shared) < len(plain)  # a prompt counts once against the budget
        assert sum(len({tuple(P[i]) for i in plan}) for plan in shared) <= 12 // 2  # prompt forwards, not 12
    assert_same_update(run_actor(tok, weights, cfg, batch), want)


class MiniBatchRecordingActor(GradRecordingActor):
    def _micro_batches(self, batch, mini, local):
        self.minis = getattr(self, "minis", [])
        self.minis.append(list(mini))
        return super()._micro_batches(batch, mini, local)


def test_group_mini_batches_hold_whole_groups(tok, weights):
    """``group_mini_batches``: the shuffle moves a prompt's samples together (found by prompt, wherever they lie),
    so a mini-batch of 6 holds two whole groups of 3, reshuffled each epoch; with ``share_prompts`` (each prompt's
    forward shared by its samples) the update equals the padded layout's over the same mini-batches."""
    batch = grouped_batch(tok, 12, 3, seed=5)
    perm = random.Random(2).sample(range(12), 12)  # the groups' samples interleaved
    batch = {k: [v[i] for i in perm] for k, v in batch.items()}
    prompts = batch["prompt_ids"]

    def run(**kw):
        model = new_model(tok, weights)
        actor = MiniBatchRecordingActor(model, actor_cfg("seq-mean-token-mean", group_mini_batches=True, **kw), tok.pad_token_id, 20)
        metrics = actor.update(batch, 0.9, 5)
        return actor.minis, (metrics, actor.grads, {k: v.detach().clone() for k, v in model.state_dict().items()})

    minis, want = run()
    assert len(minis) == 4 and want[0]["actor/grad_norm"] > 0.5
    for mini in minis:
        held = {tuple(prompts[i]) for i in mini}
        assert len(held) == 2 and sorted(mini) == sorted(i for i in range(12) if tuple(prompts[i]) in held)
    assert minis[:2] != minis[2:]  # each epoch shuffles the groups anew
    shared_minis, got = run(share_prompts=True)
    assert shared_minis == minis
    assert_same_update(got, want)


def test_shared_prompts_with_packing_is_one_line():
    with pytest.raises(ConfigError, match="share_prompts needs the padded layout"):
        load_config(None, ["actor.share_prompts=true", "actor.packing=true"])


def test_split_to_count_halves_the_largest_micro_batch_and_keeps_every_sample_once():
    """A rank with fewer micro-batches than its busiest peer halves its largest (a half never costs more tokens)."""
    assert split_to_count([[1, 2, 3, 4], [5]], 3) == [[1, 2], [3, 4], [5]]
    assert split_to_count([[1, 2, 3, 4], [5]], 4) == [[1], [2], [3, 4], [5]]
    assert split_to_count([[1], [2]], 5) == [[1], [2]]  # one sample each: the rest are filler passes
    assert split_to_count([], 2) == []
