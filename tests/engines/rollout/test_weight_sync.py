"""engines/rollout/weight_sync.py: weights between processes in memory, whole or as deltas, all or nothing."""

from __future__ import annotations

import pytest
import torch

from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama
from rlstage.engines.rollout.weight_sync import WeightReceiver, WeightSender, named_weights
from rlstage.schemas.config import KitConfig


def _models(dtype=torch.float32, seed_b: int = 1):
    tok = build_char_tokenizer()
    a = build_tiny_llama(KitConfig(), tok).to(dtype)
    b = build_tiny_llama(KitConfig(seed=seed_b), tok).to(dtype)
    return tok, a, b


def _push(sender: WeightSender, model, version: str, have: str | None, receiver: WeightReceiver, into) -> int:
    receiver.begin(sender.start(model, version, have))
    while not receiver.stage(sender.next_bucket()):
        pass
    return receiver.apply(into)


def _same(a, b) -> bool:
    wa, wb = named_weights(a), named_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.invariant("weights pushed in memory == the trainer's, whole or as a delta", "bit for bit (fp32 and bf16)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_push_makes_the_receiver_equal_and_a_delta_carries_only_what_changed(dtype):
    _, trained, held = _models(dtype)
    whole = sum(t.numel() * t.element_size() for t in named_weights(trained).values())
    sender, receiver = WeightSender(delta=True, bucket_bytes=whole // 6), WeightReceiver()
    assert _push(sender, trained, "v1", "v0", receiver, held) >= whole  # v0 was never sent: whole weights
    assert _same(trained, held) and sender.bytes >= whole
    assert held.lm_head.weight.data_ptr() == held.model.embed_tokens.weight.data_ptr()  # still tied

    # an update that moves one row of one matrix and nudges another below the dtype's resolution
    with torch.no_grad():
        trained.model.layers[0].mlp.up_proj.weight[3] += 0.5
        w = trained.model.layers[1].self_attn.q_proj.weight
        w.copy_((w.float() * (1 + 2**-30)).to(dtype))  # no bit of a float32 or bfloat16 moves
    _push(sender, trained, "v2", "v1", receiver, held)
    assert _same(trained, held)
    row = trained.model.layers[0].mlp.up_proj.weight.shape[1]
    assert sender.bytes < 2 * row * (8 + trained.dtype.itemsize) + 64  # that row only (one bucket's padding)

    # a receiver that holds another version than the one sent last gets whole weights
    assert _push(sender, trained, "v2", "v1", receiver, held) >= whole
    plain = WeightSender(delta=False, bucket_bytes=whole)
    _push(plain, trained, "v3", "v2", receiver, held)
    assert plain.bytes >= whole


def test_a_push_cut_short_or_not_fitting_writes_nothing():
    _, trained, held = _models()
    before = {k: v.clone() for k, v in named_weights(held).items()}
    whole = sum(t.numel() * t.element_size() for t in named_weights(trained).values())
    sender, receiver = WeightSender(delta=False, bucket_bytes=whole // 4), WeightReceiver()
    receiver.begin(sender.start(trained, "v1", "v0"))
    assert not receiver.stage(sender.next_bucket())  # the receiver dies here, or the sender: the rest never comes
    with pytest.raises(RuntimeError, match="weight push incomplete: 1 bucket"):
        receiver.apply(held)
    assert all(torch.equal(before[k], v) for k, v in named_weights(held).items())

    other = build_tiny_llama(KitConfig(hidden_size=32), build_char_tokenizer())
    with pytest.raises(RuntimeError, match="weight push does not fit this model"):
        _push(sender, other, "v2", None, receiver, held)
    assert all(torch.equal(before[k], v) for k, v in named_weights(held).items())
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        WeightSender(delta=True, bucket_bytes=0)


def test_a_fresh_receiver_is_sent_the_model_config_and_tokenizer():
    tok, trained, _ = _models()
    plan = WeightSender(delta=True, bucket_bytes=1 << 20).start(trained, "v1", None, tok)
    assert plan.config is trained.config and plan.tokenizer is tok and not plan.delta
    assert WeightSender(delta=True, bucket_bytes=1 << 20).start(trained, "v1", "v0", tok).tokenizer is None


def test_a_lora_policy_reaches_a_plain_receiver_merged():
    """A LoRA policy is pushed as its merged weights under its base's names (the rollout role holds a plain model)."""
    from rlstage.engines.models.lora import merged_state_dict, with_adapters
    from rlstage.schemas.config import ModelConfig

    _, base, held = _models()
    policy = with_adapters(base, ModelConfig(lora_rank=4))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that move every targeted layer
    whole = sum(t.numel() * t.element_size() for t in named_weights(held).values())
    receiver = WeightReceiver()
    _push(WeightSender(delta=True, bucket_bytes=whole // 3), policy, "v1", "v0", receiver, held)
    merged = merged_state_dict(policy)
    assert all(torch.allclose(t, merged[k]) for k, t in named_weights(held).items())
    assert not torch.equal(named_weights(held)["model.layers.0.self_attn.q_proj.weight"], _models()[1].model.layers[0].self_attn.q_proj.weight)
