"""A verl recipe as an rlstage config: ``rlstage train --verl [-c ppo_trainer.yaml] key=value ...``.

verl's keys (Hydra-style dotted overrides, or a YAML shaped like verl's ``ppo_trainer.yaml``) are translated here,
each one to its counterpart with its unit, on top of verl's own defaults for the settings that have one (a recipe
states only what differs from them). A key that only tunes speed, memory or placement is dropped with its reason;
one whose meaning rlstage cannot keep is refused. Keys that are not verl's but are rlstage settings pass through.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlstage.schemas.config import ConfigError, dotted, merge_dicts, nearest_setting, parse_overrides

AR = "actor_rollout_ref"

# verl's defaults (its ppo_trainer.yaml) where they differ from rlstage's or decide a unit: the base a recipe edits.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    f"{AR}.actor.optim.lr": 1e-6,
    f"{AR}.actor.optim.weight_decay": 0.01,
    f"{AR}.actor.ppo_mini_batch_size": 256,
    f"{AR}.actor.shuffle": False,
    f"{AR}.rollout.n": 1,
    f"{AR}.rollout.top_k": -1,
    "critic.optim.lr": 1e-5,
    "critic.optim.weight_decay": 0.01,
    "algorithm.adv_estimator": "gae",
    "trainer.total_epochs": 30,
    "trainer.test_freq": -1,
    "trainer.save_freq": -1,
}

# verl key -> the rlstage setting it is, where value and unit are the same.
SAME: dict[str, str] = {
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.filter_overlong_prompts": "data.filter_overlong_prompts",
    "data.gen_batch_size": "data.gen_batch_size",
    "data.train_batch_size": "data.prompts_per_iteration",
    "data.seed": "data.shuffle_seed",
    f"{AR}.model.path": "model.path",
    f"{AR}.model.lora_rank": "model.lora_rank",
    f"{AR}.model.lora_alpha": "model.lora_alpha",
    f"{AR}.model.target_modules": "model.target_modules",
    f"{AR}.rollout.n": "rollout.n",
    f"{AR}.rollout.temperature": "rollout.temperature",
    f"{AR}.rollout.top_p": "rollout.top_p",
    f"{AR}.rollout.enforce_eager": "rollout.vllm.enforce_eager",
    f"{AR}.rollout.max_num_seqs": "rollout.vllm.max_num_seqs",
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    f"{AR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{AR}.actor.shuffle": "actor.shuffle",
    f"{AR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{AR}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{AR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{AR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{AR}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{AR}.actor.loss_scale_factor": "actor.loss_scale_factor",
    f"{AR}.actor.calculate_sum_pi_squared": "actor.calculate_sum_pi_squared",
    f"{AR}.actor.grad_clip": "actor.optim.grad_clip",
    f"{AR}.actor.policy_loss.loss_mode": "actor.policy_loss.name",
    "critic.enable": "critic.enable",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.ppo_epochs": "critic.ppo_epochs",
    "critic.shuffle": "critic.shuffle",
    "critic.cliprange_value": "critic.cliprange_value",
    "critic.loss_agg_mode": "critic.loss_agg_mode",
    "critic.grad_clip": "critic.optim.grad_clip",
    "algorithm.adv_estimator": "algorithm.adv_estimator.name",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "trainer.critic_warmup": "critic.warmup_iterations",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_actor_ckpt_to_keep",
    "trainer.project_name": "tracking.experiment",
    "ray_kwargs.ray_init.num_cpus": "ray.num_cpus",
    "reward_model.enable": "reward_model.enable",
    "reward_model.model.path": "reward_model.model.path",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_gpu",
    "reward_model.use_dynamic_bsz": "reward_model.use_dynamic_bsz",
    "reward_model.forward_max_token_len_per_gpu": "reward_model.forward_max_token_len_per_gpu",
}
for _role in ("actor", "critic"):
    _side = f"{AR}.actor" if _role == "actor" else "critic"
    for _k, _v in {"lr": "lr", "weight_decay": "weight_decay", "betas": "betas", "clip_grad": "grad_clip",
                   "min_lr_ratio": "min_lr_ratio"}.items():  # fmt: skip
        SAME[f"{_side}.optim.{_k}"] = f"{_role}.optim.{_v}"
for _prefix in ("algorithm.kl_ctrl", "algorithm.filter_groups", "algorithm.rollout_correction"):
    for _k in {"kl_ctrl": ("type", "kl_coef", "target_kl", "horizon"), "filter_groups": ("enable", "metric", "max_num_gen_batches"),
               "rollout_correction": ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "bypass_mode", "loss_type")}[_prefix.split(".")[1]]:  # fmt: skip
        SAME[f"{_prefix}.{_k}"] = f"{_prefix}.{_k}"
for _k in ("enable", "len", "penalty_factor"):  # DAPO's overlong buffer, under both of verl's spellings
    SAME[f"reward_model.overlong_buffer.{_k}"] = f"reward.overlong_buffer.{_k}"
    SAME[f"reward_model.reward_kwargs.overlong_buffer_cfg.{_k}"] = f"reward.overlong_buffer.{_k}"
LOSS_SETTINGS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
LOSS_OWN = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")

# verl key -> (the values rlstage can keep, why another is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    f"{AR}.model.trust_remote_code": ((False,), "rlstage never runs a model folder's own code"),
    f"{AR}.model.external_lib": ((None,), "a stored config never names code to import; use plugins: [module] in rlstage's config"),
    f"{AR}.model.custom_chat_template": ((None,), "rlstage renders the model's own chat template (agent.chat_template for agents)"),
    f"{AR}.model.tokenizer_path": ((None,), "rlstage reads the tokenizer from model.path"),
    "data.prompt_key": (("prompt",), "data.source=verl_parquet reads verl's prompt column: rename the column"),
    "data.reward_fn_key": (("data_source",), "rewards are chosen by the data_source column (reward.by_data_source maps new names)"),
    "data.train_max_samples": ((-1, None), "give a file of the rows to train on"),
    "data.custom_cls.path": ((None,), "register a data source (docs: Extending) instead of a dataset class"),
    "data.sampler.class_path": ((None,), "rlstage draws each iteration's prompts itself (data.shuffle_seed)"),
    "data.datagen.path": ((None,), "register a data source that generates its prompts (docs: Extending)"),
    f"{AR}.rollout.do_sample": ((True,), "rlstage's rollouts sample (rollout.temperature; greedy is for eval)"),
    f"{AR}.rollout.ignore_eos": ((False,), "a response ends at the model's end of turn"),
    f"{AR}.rollout.multi_turn.enable": ((False,), "multi-turn rollouts are agents in rlstage (agent.enable, agent.function)"),
    f"{AR}.rollout.name": (("vllm", "hf", "sglang"), "rlstage generates with vllm or hf (rollout.engine)"),
    f"{AR}.actor.optim.optimizer": (("AdamW",), "rlstage's optimizer is AdamW"),
    f"{AR}.actor.optim.lr_scheduler_type": (("constant", "cosine"), "rlstage's schedules are constant, cosine and linear"),
    f"{AR}.actor.optim.warmup_style": ((None, "constant", "cosine"), "rlstage's schedules are constant, cosine and linear"),
    f"{AR}.actor.optim.num_cycles": ((0.5,), "rlstage's cosine decays over one half cycle"),
    "critic.optim.optimizer": (("AdamW",), "rlstage's optimizer is AdamW"),
    "critic.optim.lr_scheduler_type": (("constant",), "rlstage's critic keeps a constant rate after warm-up"),
    "trainer.val_only": ((False,), "evaluate a stored policy with `rlstage eval RUN`"),
    "algorithm.use_pf_ppo": ((False,), "PF-PPO's reweighting is not implemented"),
}

# Keys that tune speed, memory, placement or logging only: dropped, with why (the first pattern that matches).
DROPPED: list[tuple[str, str]] = [
    (r"\.(fsdp_config|megatron|fsdp)\b|\.strategy$|_offload$|ulysses|nccl_timeout|hybrid_engine",
     "FSDP/Megatron sharding: rlstage trains with torch or DeepSpeed ZeRO (actor.engine, actor.zero_stage)"),
    (r"profil|nsys|\.trace\.|timeline_json_file", "profiling: not part of a run's config"),
    (r"tensor_model_parallel_size|data_parallel_size|expert_parallel_size|pipeline_model_parallel_size",
     "model parallelism: each rollout worker holds a whole model (ray.rollout_num_workers adds replicas)"),
    (r"gpu_memory_utilization|max_num_batched_tokens|max_model_len|enable_chunked_prefill|enable_prefix_caching|"
     r"free_cache_engine|load_format|layered_summon|cudagraph|skip_tokenizer_init|scheduling_policy|"
     r"multi_stage_wake_up|disable_log_stats|rollout\.mode$|rollout\.dtype$|quantization|routing_replay",
     "the rollout engine's memory and speed: rlstage sizes vLLM by rollout.vllm.kv_cache_bytes"),
    (r"log_prob_(micro_batch_size|use_dynamic_bsz|max_token_len)|forward_micro_batch_size|\.ref\.",
     "the log-prob passes batch by actor.micro_batch_size (the reference is the starting policy)"),
    (r"use_dynamic_bsz$|ppo_max_token_len_per_gpu|forward_max_token_len_per_gpu",
     "token-budget micro-batches: actor.micro_batch_tokens is rlstage's (set it to keep verl's budget)"),
    (r"enable_gradient_checkpointing|enable_activation_offload|use_remove_padding|use_fused_kernels|"
     r"fused_kernel_options|use_liger|tiled_mlp|entropy_from_logits_with_chunking|_checkpointing$|use_prefix_grouper",
     "memory and kernels: rlstage computes log-probs in chunks of actor.logits_chunk_tokens (actor.packing drops padding)"),
    (r"^trainer\.(nnodes|n_gpus_per_node|device)$|n_gpus_per_node|nnodes|enable_resource_pool|\.num_workers$",
     "placement: rlstage places its roles on Ray by ray.* (ray.trainer_world_size, ray.worker_num_gpus)"),
    (r"^trainer\.(logger|log_val_generations|rollout_data_dir|validation_data_dir|experiment_name)$",
     "tracking: every run is logged to MLflow, and its rollouts are stored in the run's artifacts (rlstage inspect)"),
    (r"^trainer\.(resume_mode|resume_from_path|default_hdfs_dir|del_local_ckpt_after_load|default_local_dir|"
     r"esi_redundant_time|ray_wait_register_center_timeout|use_legacy_worker_impl|max_critic_ckpt_to_keep)$|\.checkpoint\.",
     "checkpoints: rlstage stores each iteration's artifacts in store.root and continues with `rlstage nightly`"),
    (r"dataloader_num_workers|filter_overlong_prompts_workers|use_shm|^data\.(tokenizer|val_batch_size|return_raw_chat|"
     r"return_full_prompt|validation_shuffle|image_key|video_key|image_patch_size|tool_config_path|trust_remote_code|shuffle)$",
     "data loading: rlstage renders each prompt with the model's chat template and draws prompts by data.shuffle_seed"),
    (r"data_loader_seed$|rollout_n$|freeze_vision_tower|calculate_entropy|calculate_log_probs|logprobs_mode|"
     r"over_sample_rate|optimizer_impl|skip_rollout|skip_dump_dir|balance_batch",
     "kept as rlstage does it: its update shuffle follows trainer.seed, entropy and rollout log-probs are always recorded"),
    (r"^reward_model\.(reward_manager|reward_loop_source|reward_loop_module_path|reward_loop_class_name|"
     r"launch_reward_fn_async|use_reward_loop|sandbox_fusion|rollout|strategy|max_length|micro_batch_size$|model\.(use_|trust|external))|"
     r"^reward_manager\.",
     "the reward loop: rlstage scores each sample in a process pool (reward.timeout_s bounds one)"),
    (r"\.val_kwargs\.(top_k|top_p|temperature|do_sample)$", "held-out evaluation is greedy, plus trainer.eval_n samples at the rollout's sampling"),
    (r"^critic\.model\.", "rlstage's critic starts from the policy's model (model.path) with a fresh value head"),
    (r"lr_warmup_steps_ratio|total_training_steps$|warmup_style$|\.optim\.lr_scheduler_type$|\.optim\.optimizer$|num_cycles",
     "the learning-rate schedule (translated above where it is set)"),
    (r"^(hydra|defaults)\b|^ray_kwargs\.", "Hydra's own and Ray's start-up settings"),
]


@dataclass
class Recipe:
    """The translated recipe: the rlstage settings it makes, and a line for what was mapped, dropped or refused."""

    tree: dict = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, verl_key: str, note: str = "") -> None:
        node = self.tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        self.mapped.append(f"{verl_key} -> {key}={_show(value)}" + (f" ({note})" if note else ""))


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _parse_override(item: str) -> tuple[str, Any] | None:
    """Hydra's ``key=value``, ``+key=value`` and ``++key=value``; ``~key`` (delete: verl's default) gives None."""
    if item.startswith("~"):
        return None
    if "=" not in item:
        raise ConfigError(f"config error: verl override {item!r} is not key=value")
    key, value = item.lstrip("+").split("=", 1)
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value  # Hydra would keep an unparsable value as a string
    if isinstance(parsed, str) and _NUMBER.match(parsed):
        parsed = float(parsed)  # Hydra reads 1e-6 as a number (YAML 1.1 wants 1.0e-6)
    return key.strip(), parsed


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _is_verl_key(key: str) -> bool:
    return (
        key in SAME or key in REFUSED or key in VERL_DEFAULTS or key in OTHER_KEYS
        or any(re.search(p, key) for p, _ in DROPPED)
    )


# verl keys translated by hand in translate() and _schedule()
OTHER_KEYS = frozenset({
    "data.train_files", "data.val_files", "data.truncation", "trainer.total_epochs", "trainer.total_training_steps",
    "trainer.save_freq", "trainer.test_freq", "trainer.val_before_train", "custom_reward_function.path",
    "custom_reward_function.name", f"{AR}.rollout.val_kwargs.n", f"{AR}.rollout.top_k", f"{AR}.rollout.name",
    f"{AR}.actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size", f"{AR}.actor.clip_ratio",
    *(f"{AR}.actor.{k}" for k in LOSS_SETTINGS), *(f"{AR}.actor.policy_loss.{k}" for k in LOSS_OWN),
    *(f"{AR}.actor.optim.{k}" for k in ("lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps", "lr_scheduler_type")),
})  # fmt: skip


def _nearest(key: str) -> str | None:
    import difflib

    verl = sorted({*SAME, *REFUSED, *VERL_DEFAULTS, *OTHER_KEYS})
    close = difflib.get_close_matches(key, verl, n=1, cutoff=0.8)
    return close[0] if close else nearest_setting(key)


def read_recipe(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """verl's keys of a recipe, dotted: the YAML's, then the overrides' (interpolations left to verl's defaults)."""
    keys: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config error: verl config {p} does not exist") from None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"config error: verl config {p} is not readable YAML ({type(err).__name__})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: verl config {p} must hold a mapping")
        keys.update({k: v for k, v in dotted(loaded).items() if not (isinstance(v, str) and "${" in v)})
    for item in overrides:
        parsed = _parse_override(item)
        if parsed is not None:
            keys[parsed[0]] = parsed[1]
    return keys


def translate(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> Recipe:
    """verl's recipe (a ``ppo_trainer.yaml``-shaped file and/or Hydra overrides) as rlstage settings."""
    from rlstage.schemas.settings_help import setting_paths

    given = read_recipe(path, overrides)
    known = setting_paths()
    own = {k: v for k, v in given.items() if not _is_verl_key(k) and k in known}
    unknown = [k for k in given if not _is_verl_key(k) and k not in known]
    if unknown:
        def named(key: str) -> str:
            near = _nearest(key)
            return f"{key} (did you mean {near}?)" if near else key

        raise ConfigError(
            f"config error: {', '.join(named(k) for k in unknown)}: neither a verl key rlstage translates nor an rlstage setting"
        )
    keys = {**VERL_DEFAULTS, **{k: v for k, v in given.items() if k not in own}}
    recipe = Recipe(passthrough=[f"{k}={_show(v)}" for k, v in own.items()])
    recipe.tree["data"] = {"source": "verl_parquet"}

    for key, value in keys.items():
        if key in REFUSED:
            ok, why = REFUSED[key]
            if value not in ok:
                raise ConfigError(f"config error: verl's {key}={_show(value)} has no counterpart in rlstage: {why}")
    n = int(keys[f"{AR}.rollout.n"])
    critic_on = keys.get("critic.enable")
    critic_on = keys["algorithm.adv_estimator"] == "gae" if critic_on is None else bool(critic_on)
    handled: set[str] = set()

    def take(key: str) -> Any:
        handled.add(key)
        return keys.get(key)

    for verl_key, ours in SAME.items():
        if ours.startswith("critic.") and not critic_on and verl_key != "critic.enable":
            continue  # no critic: its settings say nothing (a given one is listed as dropped)
        if verl_key in keys:
            recipe.set(ours, take(verl_key), verl_key, "" if verl_key in given else "verl's default")
    for side, ours in ((f"{AR}.actor", "actor"), ("critic", "critic"))[: 2 if critic_on else 1]:
        mini = take(f"{side}.ppo_mini_batch_size")
        if mini is None and side == "critic":
            mini = keys[f"{AR}.actor.ppo_mini_batch_size"]  # verl's critic takes the actor's
        recipe.set(f"{ours}.ppo_mini_batch_size", int(mini) * n, f"{side}.ppo_mini_batch_size={mini}",
                   f"verl counts prompts, rlstage samples: x rollout.n={n}")  # fmt: skip
        if keys.get(f"{side}.ppo_micro_batch_size_per_gpu") is None:  # verl requires one; the whole mini-batch at once
            recipe.set(f"{ours}.micro_batch_size", int(mini) * n, f"{side}.ppo_micro_batch_size_per_gpu (unset)", "one micro-batch a mini-batch")
        if keys.get(f"{side}.use_dynamic_bsz"):
            recipe.set(f"{ours}.micro_batch_tokens", int(keys.get(f"{side}.ppo_max_token_len_per_gpu") or 16384),
                       f"{side}.use_dynamic_bsz", "token-budget micro-batches")  # fmt: skip
    # PPO's clip settings sit beside the loss's name in rlstage (verl's clip_ratio sets both bounds unless they are given)
    loss = f"{AR}.actor"
    if "clip_ratio" in (k.rsplit(".", 1)[-1] for k in keys if k.startswith(loss + ".")):
        ratio = take(f"{loss}.clip_ratio")
        for bound in ("clip_ratio_low", "clip_ratio_high"):
            keys.setdefault(f"{loss}.{bound}", ratio)
    for name in LOSS_SETTINGS[1:]:
        if f"{loss}.{name}" in keys:
            recipe.set(f"actor.policy_loss.{name}", take(f"{loss}.{name}"), f"{loss}.{name}")
    for name in LOSS_OWN:
        if f"{loss}.policy_loss.{name}" in keys:
            recipe.set(f"actor.policy_loss.{name}", take(f"{loss}.policy_loss.{name}"), f"{loss}.policy_loss.{name}")
    # verl's top_k -1 is rlstage's 0 (off)
    top_k = take(f"{AR}.rollout.top_k")
    recipe.set("rollout.top_k", 0 if top_k in (-1, None) else int(top_k), f"{AR}.rollout.top_k={top_k}", "verl's -1 is rlstage's 0: off" if top_k == -1 else "")
    engine = take(f"{AR}.rollout.name")
    if engine is not None:
        recipe.set("rollout.engine", "vllm" if engine == "sglang" else engine, f"{AR}.rollout.name={engine}",
                   "rlstage has no sglang engine" if engine == "sglang" else "")  # fmt: skip
    # files: a single parquet file each, verl's preprocessed rows
    for verl_key, ours in (("data.train_files", "data.train_path"), ("data.val_files", "data.test_path")):
        files = take(verl_key)
        if files is None:
            continue
        files = files if isinstance(files, list) else [files]
        if len(files) != 1:
            raise ConfigError(f"config error: verl's {verl_key} names {len(files)} files; rlstage reads one file a split (join them)")
        recipe.set(ours, str(Path(str(files[0])).expanduser()), verl_key)
    truncation = take("data.truncation")
    if truncation not in (None, "error"):
        raise ConfigError(
            f"config error: verl's data.truncation={truncation} has no counterpart in rlstage: it never cuts a prompt "
            "(data.filter_overlong_prompts=true drops an over-long one; false stops data prep at it)"
        )
    # the critic: verl trains one for gae unless told
    if keys.get("critic.enable") is None:
        recipe.set("critic.enable", critic_on, "critic.enable (unset)", "verl trains a critic for gae, and only then")
    # custom_reward_function: verl's {path, name} form is rlstage's reward.function
    reward_file, name = take("custom_reward_function.path"), take("custom_reward_function.name") or "compute_score"
    if reward_file is not None:
        recipe.set("reward.function", f"{Path(str(reward_file)).expanduser()}:{name}", "custom_reward_function")
    _schedule(recipe, keys, take, n, iterations_given="trainer.iterations" in own)
    for verl_key in keys:
        if verl_key in handled or verl_key in VERL_DEFAULTS and verl_key not in given:
            continue
        why = next((why for pattern, why in DROPPED if re.search(pattern, verl_key)), None)
        if verl_key.startswith("critic.") or verl_key == "trainer.critic_warmup":
            why = why or "the run trains no critic (critic.enable)"
        if verl_key in REFUSED:  # a value it can keep that changes nothing here
            why = why or "rlstage does the same"
        recipe.dropped.append(f"{verl_key}={_show(keys[verl_key])}: {why or 'no counterpart in rlstage'}")
    return recipe


def _schedule(recipe: Recipe, keys: dict[str, Any], take, n: int, iterations_given: bool) -> None:
    """Iterations, evaluation, checkpoints and the learning-rate schedule: verl counts them in training steps."""
    steps = take("trainer.total_training_steps")
    epochs = take("trainer.total_epochs")
    batch = int(keys["data.train_batch_size"])
    if steps is None:
        rows = _rows(keys.get("data.train_files"))
        if rows is None and iterations_given:
            rows = 0  # the rlstage setting given beside the recipe decides
        elif rows is None:
            raise ConfigError("config error: verl's trainer.total_epochs needs data.train_files (its rows count the steps); or give trainer.total_training_steps")
        steps = (rows // batch) * int(epochs)
        recipe.set("trainer.iterations", steps, f"trainer.total_epochs={epochs}", f"{rows} rows // data.train_batch_size={batch} x {epochs} epochs, as verl's dataloader drops the last partial batch")  # fmt: skip
    else:
        recipe.set("trainer.iterations", int(steps), "trainer.total_training_steps")
    test = take("trainer.test_freq")
    recipe.set("trainer.eval_every", max(int(steps), 1) if test in (None, -1, 0) else int(test), f"trainer.test_freq={test}",
               "rlstage always evaluates the start and the last policy" if test in (None, -1, 0) else "")  # fmt: skip
    save = take("trainer.save_freq")
    if save not in (None, -1, 0):
        recipe.set("trainer.checkpoint_every", int(save), "trainer.save_freq")
    if take("trainer.val_before_train") is False:
        recipe.dropped.append("trainer.val_before_train=false: rlstage always evaluates the start policy (its learning line's baseline)")
    val_n = take(f"{AR}.rollout.val_kwargs.n")
    if val_n not in (None, 1):
        recipe.set("trainer.eval_n", int(val_n), f"{AR}.rollout.val_kwargs.n")
    # verl steps its schedule once a training step; rlstage once an optimizer step
    per_step = max(1, batch // int(keys[f"{AR}.actor.ppo_mini_batch_size"])) * int(keys.get(f"{AR}.actor.ppo_epochs") or 1)
    side = f"{AR}.actor.optim"
    style = take(f"{side}.lr_scheduler_type") or take(f"{side}.warmup_style")
    if style not in (None, "constant"):
        recipe.set("actor.optim.lr_schedule", style, f"{side}.lr_scheduler_type")
    warmup, ratio = take(f"{side}.lr_warmup_steps"), take(f"{side}.lr_warmup_steps_ratio")
    total = take(f"{side}.total_training_steps")
    total = int(steps) if total in (None, -1) else int(total)
    verl_warmup = int(warmup) if warmup not in (None, -1) else math.floor(float(ratio or 0.0) * total)
    if verl_warmup:
        recipe.set("actor.optim.warmup_steps", verl_warmup * per_step, f"{side}.lr_warmup_steps={verl_warmup} training steps",
                   f"x {per_step} optimizer steps a training step")  # fmt: skip
    if style not in (None, "constant"):
        recipe.set("actor.optim.total_steps", total * per_step, f"{side}.total_training_steps={total}", f"x {per_step} optimizer steps a training step")


def _rows(files: Any) -> int | None:
    if files is None:
        return None
    first = files[0] if isinstance(files, list) else files
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(Path(str(first)).expanduser()).num_rows
    except (OSError, ValueError):
        return None  # data prep names the file's problem in its own line


def config_tree(recipe: Recipe) -> dict:
    """The recipe's rlstage settings with the pass-through rlstage overrides on top."""
    return merge_dicts(recipe.tree, parse_overrides(recipe.passthrough))
