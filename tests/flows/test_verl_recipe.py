"""verl recipes with their own keys (flows/verl_recipe.py): verl's GSM8K GRPO recipe translated, its dropped keys and
refusals (`rlstage train --verl` trains it: tests/integration/test_verl_recipe_run.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlstage.flows.verl_recipe import config_tree, translate
from rlstage.schemas.config import ConfigError, build_config
from tests_support import AR, VERL_QWEN2_7B_GRPO


def _recipe(tmp_path: Path, model: str = "/models/qwen", rows: int = 7473) -> list[str]:
    train = tmp_path / "train.parquet"
    if not train.exists():
        pq.write_table(pa.table({"data_source": ["openai/gsm8k"] * rows}), train)  # only its row count is read
    return [k.format(train=train, test=train, model=model) for k in VERL_QWEN2_7B_GRPO]


def test_verls_grpo_recipe_maps_each_key_with_its_unit_and_drops_the_rest_with_why(tmp_path: Path) -> None:
    recipe = translate(None, _recipe(tmp_path))
    cfg = build_config(config_tree(recipe))
    assert cfg.data.source == "verl_parquet" and cfg.data.prompts_per_iteration == 1024
    assert (cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, cfg.rollout.n, cfg.rollout.engine) == (512, 1024, 5, "vllm")
    assert cfg.actor.ppo_mini_batch_size == 256 * 5  # verl counts prompts, rlstage samples
    assert cfg.actor.micro_batch_size == 40 and cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "low_var_kl"
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.optim.weight_decay == 0.01  # verl's default weight decay, not ours
    assert cfg.actor.shuffle is False and cfg.rollout.top_k == 0  # verl's defaults: no update shuffle, top_k -1 (off)
    assert cfg.algorithm.adv_estimator.name == "grpo" and not cfg.critic.enable
    assert cfg.trainer.iterations == 7473 // 1024 * 15  # verl's dataloader drops the last partial batch
    assert (cfg.trainer.eval_every, cfg.trainer.checkpoint_every, cfg.tracking.experiment) == (5, 20, "verl_grpo_example_gsm8k")
    dropped = {line.split("=", 1)[0]: line for line in recipe.dropped}
    assert set(dropped) == {
        f"{AR}.model.use_remove_padding", f"{AR}.model.enable_gradient_checkpointing", f"{AR}.actor.fsdp_config.param_offload",
        f"{AR}.actor.fsdp_config.optimizer_offload", f"{AR}.rollout.log_prob_micro_batch_size_per_gpu",
        f"{AR}.rollout.tensor_model_parallel_size", f"{AR}.rollout.gpu_memory_utilization", f"{AR}.ref.log_prob_micro_batch_size_per_gpu",
        f"{AR}.ref.fsdp_config.param_offload", "trainer.logger", "trainer.experiment_name", "trainer.n_gpus_per_node", "trainer.nnodes",
        "trainer.critic_warmup",  # no critic in a GRPO run
    }  # fmt: skip
    assert "model parallelism" in dropped[f"{AR}.rollout.tensor_model_parallel_size"]
    assert all(": " in line and "\n" not in line for line in recipe.dropped)
    # every key of the recipe is either mapped or dropped
    mapped = " ".join(recipe.mapped)
    for key in (k.split("=", 1)[0] for k in VERL_QWEN2_7B_GRPO):
        assert key in mapped or key in dropped or key == "data.truncation", key


def test_a_ppo_trainer_shaped_yaml_and_rlstage_settings_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"train_files": str(tmp_path / "t.parquet"), "val_files": str(tmp_path / "v.parquet"), "train_batch_size": 8, "max_response_length": 64},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "clip_ratio": 0.28, "optim": {"lr_warmup_steps_ratio": 0.5,
                              "lr_scheduler_type": "cosine"}}, "rollout": {"n": 2, "top_k": 20, "prompt_length": "${data.max_prompt_length}"}},
        "trainer": {"total_training_steps": 4},
    }))  # fmt: skip
    recipe = translate(path, [f"{AR}.actor.clip_ratio_high=0.3", "rollout.max_logprob_gap=0.1"])
    cfg = build_config(config_tree(recipe))
    assert cfg.critic.enable  # verl's default estimator is gae, which trains a critic
    assert cfg.critic.ppo_mini_batch_size == 4 * 2 and cfg.actor.ppo_mini_batch_size == 8
    assert cfg.actor.policy_loss.settings == {"clip_ratio_low": 0.28, "clip_ratio_high": 0.3}
    assert cfg.rollout.top_k == 20 and cfg.rollout.max_logprob_gap == 0.1  # the rlstage setting passes through
    # verl steps its schedule once a training step (2 optimizer steps each here): warm-up 0.5 x 4 steps
    assert (cfg.actor.optim.lr_schedule, cfg.actor.optim.warmup_steps, cfg.actor.optim.total_steps) == ("cosine", 4, 8)
    assert cfg.trainer.iterations == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"{AR}.model.trust_remote_code=True"], r"trust_remote_code=true has no counterpart in rlstage: rlstage never runs"),
        (["data.truncation=left"], r"data\.truncation=left has no counterpart in rlstage: it never cuts a prompt"),
        ([f"{AR}.rollout.do_sample=False"], r"do_sample=false has no counterpart"),
        (["data.train_files=[a.parquet,b.parquet]", "trainer.total_training_steps=1"], r"names 2 files; rlstage reads one file a split"),
        (["trainer.total_epochs=2"], r"trainer\.total_epochs needs data\.train_files"),
        ([f"{AR}.actor.ppo_mini_batchsize=4", "trainer.totl_epochs=1"],
         r"ppo_mini_batchsize \(did you mean actor_rollout_ref\.actor\.ppo_mini_batch_size\?\), trainer\.totl_epochs \(did you mean "
         r"trainer\.total_epochs\?\): neither a verl key rlstage translates nor an rlstage setting"),
    ],
)  # fmt: skip
def test_what_rlstage_cannot_keep_is_refused_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        translate(None, overrides)
    assert "\n" not in str(err.value) and str(err.value).startswith("config error: ")
