"""LoRA policies (engines/models/lora.py): only the adapters train, the reference is the base with its adapters
disabled, merged weights equal the adapted forward, checkpoints hold the adapter and a reference to the base."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from rlstage.engines.models.lora import BASE_REF, save_adapters, save_hf, with_adapters
from rlstage.engines.models.tinykit import build_char_tokenizer, build_tiny_llama, save_model_dir
from rlstage.engines.preflight import preflight
from rlstage.engines.training.actor import TorchActor
from rlstage.engines.training.checkpoint import load_trainer_state, save_trainer_state
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import ConfigError, load_config
from rlstage.schemas.manifest import PolicyRef
from rlstage.workers.policy import load_policy_model

KIT = ["kit.hidden_size=32", "kit.num_layers=1", "kit.num_heads=2", "kit.intermediate_size=64"]
LORA = ["model.lora_rank=4", *KIT]


def _batch(tok, n: int = 8) -> dict[str, list]:
    """Prompts with fixed responses and alternating-sign advantages: a policy-gradient step moves the weights."""
    g = torch.Generator().manual_seed(0)
    prompts = [tok.encode(f"What is {i}+{i + 1}? ") for i in range(n)]
    responses = [torch.randint(4, len(tok), (3,), generator=g).tolist() for _ in range(n)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1.0] * 3 for _ in range(n)],
        "old_log_probs": [[-3.0] * 3 for _ in range(n)],
        "advantages": [[1.0 if i % 2 else -1.0] * 3 for i in range(n)],
    }


@pytest.fixture
def kit():
    cfg = load_config(None, [*LORA, "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=8", "actor.optim.lr=1e-2"])
    tok = build_char_tokenizer()
    base = build_tiny_llama(cfg.kit, tok)
    return cfg, tok, base


def _logits(model, tok) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tok.encode("What is 12+34? 46")])).logits


def test_only_the_adapters_train_and_the_reference_is_the_base(kit) -> None:
    cfg, tok, base = kit
    before = copy.deepcopy(base.state_dict())
    base_logits = _logits(base, tok)
    policy = with_adapters(base, cfg.model)
    actor = TorchActor(policy, cfg.actor, tok.pad_token_id, total_steps=10)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in actor.optimizer.param_groups) == len(trainable)
    lora_before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    actor.update(_batch(tok), temperature=1.0, seed=0)
    moved = [n for n, p in policy.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert any("lora_B" in n for n in moved)  # B starts at 0: the step made the adapters non-trivial
    for key, value in policy.get_base_model().state_dict().items():
        if ".lora_" not in key:
            assert torch.equal(value, before[key.replace(".base_layer.", ".")]), key
    assert not torch.allclose(_logits(policy, tok), base_logits, atol=1e-4)
    with policy.disable_adapter():  # the reference policy: no second copy, the base's exact logits
        assert torch.equal(_logits(policy, tok), base_logits)


def test_merged_export_equals_the_adapted_forward(kit, tmp_path: Path) -> None:
    cfg, tok, base = kit
    policy = with_adapters(base, cfg.model)
    TorchActor(policy, cfg.actor, tok.pad_token_id, 10).update(_batch(tok), 1.0, 0)
    save_hf(policy, tok, tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    torch.testing.assert_close(_logits(merged, tok), _logits(policy, tok), atol=1e-5, rtol=0)


def test_checkpoint_holds_the_adapter_and_a_base_reference_and_resumes(kit, tmp_path: Path) -> None:
    cfg, tok, base = kit
    base_dir = save_model_dir(base, tok, tmp_path / "base")
    base_ref = PolicyRef(version=f"path:{base_dir}", path=str(base_dir))
    store = ArtifactStore(str(tmp_path / "store"))
    policy, ref = load_policy_model(cfg, store, base_ref, base_dir, tmp_path / "scratch", trainable=True)
    assert ref == base_ref  # a plain folder becomes the base of fresh adapters
    actor = TorchActor(policy, cfg.actor, tok.pad_token_id, 10)
    actor.update(_batch(tok), 1.0, 0)
    ckpt = tmp_path / "ckpt"
    save_adapters(policy, tok, ckpt / "model", ref)
    save_trainer_state(actor.state_dict(), ckpt / "state")
    files = {p.name for p in (ckpt / "model").iterdir()}
    assert "adapter_model.safetensors" in files and BASE_REF in files and "model.safetensors" not in files
    assert (ckpt / "model" / "adapter_model.safetensors").stat().st_size < (base_dir / "model.safetensors").stat().st_size / 5
    ckpt_ref = PolicyRef(version="ckpt-1", path=str(ckpt / "model"))
    resumed, resumed_base = load_policy_model(cfg, store, ckpt_ref, ckpt / "model", tmp_path / "scratch", trainable=True)
    assert resumed_base == base_ref  # the reference policy stays the base
    assert torch.equal(_logits(resumed, tok), _logits(policy, tok))
    again = TorchActor(resumed, cfg.actor, tok.pad_token_id, 10)
    again.load_state_dict(load_trainer_state(ckpt / "state"))
    # the resumed trainer takes the same next step as the one that kept running
    batch = _batch(tok)
    actor.update(batch, 1.0, 1)
    again.update(batch, 1.0, 1)
    torch.testing.assert_close(_logits(resumed, tok), _logits(policy, tok), atol=1e-6, rtol=0)
    other = load_config(None, [*KIT, "model.lora_rank=8"])
    with pytest.raises(ConfigError, match=r"^config error: model\.lora_rank=8, but the stored adapter .* has 4$"):
        load_policy_model(other, store, ckpt_ref, ckpt / "model", tmp_path / "scratch", trainable=True)
    full = load_config(None, KIT)
    with pytest.raises(ConfigError, match=r"^config error: model\.lora_rank: ckpt-1 is a LoRA adapter"):
        load_policy_model(full, store, ckpt_ref, ckpt / "model", tmp_path / "scratch", trainable=True)


def test_fresh_adapters_are_drawn_from_the_run_seed(kit, tmp_path: Path) -> None:
    """A rerun (or a replay of the first update) starts from the same adapters, whatever its process drew before."""
    cfg, tok, base = kit
    base_dir = save_model_dir(base, tok, tmp_path / "base")
    base_ref = PolicyRef(version=f"path:{base_dir}", path=str(base_dir))
    store = ArtifactStore(str(tmp_path / "store"))

    def adapters(config, draws: int) -> dict[str, torch.Tensor]:
        torch.rand(draws)  # what ran in the process before: another stage, another model
        state = torch.random.get_rng_state()
        policy, _ = load_policy_model(config, store, base_ref, base_dir, tmp_path / "scratch", trainable=True)
        assert torch.equal(torch.random.get_rng_state(), state)  # the process's own draws are not moved
        return {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_A" in n}

    first, again = adapters(cfg, 1), adapters(cfg, 1000)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    other = adapters(load_config(None, [*LORA, "trainer.seed=1"]), 1)
    assert not any(torch.equal(first[n], other[n]) for n in first)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["model.target_modules=[q_proj, qkv_proj]"], r"config error: model\.target_modules: 'qkv_proj' matches no module of the tiny kit's Llama"),
        (["model.lora_rank=0", "model.target_modules=[q_proj]"], r"config error: model: model\.lora_rank=0 turns LoRA off, but model\.target_modules is set"),
        (["model.lora_rank=0", "model.lora_alpha=32"], r"config error: model: model\.lora_rank=0 turns LoRA off, but model\.lora_alpha is set"),
        (["model.lora_rank=-1"], r"config error: model\.lora_rank: Input should be greater than or equal to 0"),
        (["model.target_modules=[]"], r"config error: model\.target_modules: name at least one module"),
        (["actor.engine=deepspeed", "actor.zero_stage=3"], r"config error: <root>: model\.lora_rank=4 with actor\.zero_stage=3"),
        (["model.lora_rank=1024", "rollout.engine=vllm"], r"config error: model\.lora_rank: model\.lora_rank=1024: rollout\.engine=vllm serves LoRA adapters of rank 512 at most"),
    ],
)
def test_bad_lora_settings_are_one_line_naming_the_key(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, [*LORA, *overrides]))
    assert "\n" not in str(err.value)
    assert re.match(line, str(err.value)), str(err.value)
