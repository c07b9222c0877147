"""The learning-rate schedule: HF/verl warm-up and decay values per optimizer step, stepped by the update."""

import math

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.training.actor import TorchActor, lr_lambda
from rlstage.schemas.config import ActorConfig, KitConfig, OptimConfig, RunConfig
from rlstage.workers.group import total_update_steps


def test_cosine_with_warmup_values_per_step():
    # warm-up 4, total 14, floor 0.1: step/4 from 0, then 0.1 + 0.9 * 0.5 * (1 + cos(pi * (s - 4) / 10))
    fn = lr_lambda(OptimConfig(warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1), total_steps=14)
    assert [fn(s) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert fn(4) == pytest.approx(1.0)
    assert fn(9) == pytest.approx(0.55)  # half-way: cos(pi/2) = 0
    assert fn(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert fn(14) == pytest.approx(0.1)
    assert fn(30) == pytest.approx(0.1)  # past the end: the floor, not a second cycle


def test_linear_and_constant_schedules():
    lin = lr_lambda(OptimConfig(warmup_steps=2, lr_schedule="linear"), total_steps=12)
    assert [lin(s) for s in (0, 1, 2, 7, 12)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])
    const = lr_lambda(OptimConfig(warmup_steps=3), total_steps=12)
    assert [const(s) for s in (0, 1, 2, 3, 11, 50)] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0])


def test_total_steps_count_optimizer_steps_of_the_run():
    cfg = RunConfig.model_validate(
        {"data": {"prompts_per_iteration": 12}, "rollout": {"n": 4}, "trainer": {"iterations": 3},
         "actor": {"ppo_mini_batch_size": 16, "micro_batch_size": 16, "ppo_epochs": 2}}
    )  # fmt: skip
    assert total_update_steps(cfg) == (12 * 4 // 16) * 2 * 3  # mini-batches x epochs x iterations


def test_update_steps_the_schedule_once_per_optimizer_step():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_llama(KitConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok)
    optim = OptimConfig(lr=1e-3, warmup_steps=2, lr_schedule="linear")
    cfg = ActorConfig(ppo_mini_batch_size=2, micro_batch_size=2, ppo_epochs=2, optim=optim)
    total = 16  # two updates of 8 samples: 4 mini-batches x 2 epochs each
    actor = TorchActor(model, cfg, tok.pad_token_id, total)
    p = tok("What is 1+1? ", add_special_tokens=False)["input_ids"]
    r = tok("2", add_special_tokens=False)["input_ids"]
    batch = {
        "prompt_ids": [p] * 8, "response_ids": [r] * 8, "response_mask": [[1]] * 8,
        "old_log_probs": actor.compute_log_probs([p] * 8, [r] * 8, 1.0),
        "advantages": [[1.0], [-1.0]] * 4,
    }  # fmt: skip
    fn = lr_lambda(optim, total)
    for update in range(2):
        metrics = actor.update(batch, 1.0, seed=update)
        steps = range(8 * update, 8 * (update + 1))
        assert metrics["actor/lr"] == pytest.approx(1e-3 * sum(fn(s) for s in steps) / 8)
        assert actor.scheduler.last_epoch == 8 * (update + 1)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)  # decayed to the floor at the run's end


def test_fused_adamw_takes_the_default_loops_steps():
    """``optim.fused`` builds torch's fused AdamW: the same update as the default loop up to rounding, and the
    schedule still drives its lr."""
    tok = build_char_tokenizer()
    p = tok("What is 1+1? ", add_special_tokens=False)["input_ids"]
    r = tok("2", add_special_tokens=False)["input_ids"]
    weights = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_tiny_llama(KitConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok)
        start = [t.detach().clone() for t in model.parameters()]
        optim = OptimConfig(lr=1e-2, lr_schedule="linear", fused=fused)
        actor = TorchActor(model, ActorConfig(ppo_mini_batch_size=4, micro_batch_size=4, optim=optim), tok.pad_token_id, 8)
        assert actor.optimizer.defaults["fused"] is (True if fused else None)
        batch = {
            "prompt_ids": [p] * 8, "response_ids": [r] * 8, "response_mask": [[1]] * 8,
            "old_log_probs": actor.compute_log_probs([p] * 8, [r] * 8, 1.0),
            "advantages": [[1.0], [-1.0], [1.0], [0.5]] * 2,
        }  # fmt: skip
        actor.update(batch, 1.0, seed=0)
        # two mini-batches of 4 stepped: the schedule set the lr the fused kernel reads
        assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_lambda(optim, 8)(2))
        weights[fused] = [t.detach() for t in model.parameters()]
        assert max(float((a - b).abs().max()) for a, b in zip(weights[fused], start, strict=True)) > 1e-3  # it moved
    for a, b in zip(weights[False], weights[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
