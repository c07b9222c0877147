"""Checks of a valid config against this machine, run once by every flow before any stage.

The config model (schemas/config/) checks only the config itself; what needs a model directory,
a tokenizer, a user's module or an installed package is checked here, with the same one-line
``config error: <key>: ...`` messages, so a bad setting fails before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from rlstage.engines.agents.tools import ToolConfigError, check_parameters_schema, resolve_callable
from rlstage.engines.plugins import load_plugins
from rlstage.engines.registry import (
    CHECKED_SETTINGS,
    REGISTRIES,
    check_flat_reads,
    named_values,
    settings_for,
)
from rlstage.engines.rewards.rules import check_reward_fn
from rlstage.schemas.config import FLAT_AGG_SETTINGS, ConfigError, RunConfig


def check_model(cfg: RunConfig) -> None:
    """The model fits the prompts: a chat template for chat messages, a context for prompt + response.

    Whether the folder and the data files exist and read is checked before (flows/checks.py).
    """
    if cfg.model.path is not None and cfg.model.path.lower().endswith(".gguf"):
        return  # converted into a folder at run start (flows/training.py: with_model_folder), checked then
    from rlstage.engines.data.datasets import uses_kit

    if cfg.model.path is not None and not uses_kit(cfg.data.source):  # gsm8k and verl rows are chat messages
        from rlstage.engines.models.chat import check_chat_template, policy_tokenizer

        check_chat_template(policy_tokenizer(cfg.model.path), f"data.source={cfg.data.source}")
    if cfg.model.path is not None:
        context = json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text()).get("max_position_embeddings")
        key, new = (
            ("agent.max_response_tokens", cfg.agent.max_response_tokens)
            if cfg.agent.enable
            else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
        )
        if context and cfg.data.max_prompt_length + new > context:
            raise ConfigError(
                f"config error: {key}: data.max_prompt_length + {key} = {cfg.data.max_prompt_length + new} "
                f"exceeds the context of model.path {cfg.model.path} ({context} tokens)"
            )


def check_lora(cfg: RunConfig) -> None:
    """Every ``model.target_modules`` entry names modules the policy has (peft would fail only at the first update)."""
    m = cfg.model
    if not m.lora or (m.path is not None and m.path.lower().endswith(".gguf")):
        return  # a .gguf file is converted at run start (flows/training.py: with_model_folder), checked then
    from transformers import AutoConfig

    from rlstage.engines.models.lora import missing_targets, model_skeleton
    from rlstage.engines.models.tinykit import build_char_tokenizer, tiny_llama_config

    config = tiny_llama_config(cfg.kit, build_char_tokenizer()) if m.path is None else AutoConfig.from_pretrained(m.path)
    missing = missing_targets(model_skeleton(config), m.target_modules)
    if missing:
        where = "the tiny kit's Llama" if m.path is None else f"model.path {m.path}"
        raise ConfigError(
            f"config error: model.target_modules: {', '.join(map(repr, missing))} matches no module of {where} "
            f"({config.architectures[0] if config.architectures else config.model_type})"
        )


def check_engines(cfg: RunConfig) -> None:
    """The rollout engine is installed, the tools import and the chat template renders tool turns."""
    from rlstage.engines.rollout.engines import engine_traits

    # find_spec does not import vllm: the check costs nothing on machines without it.
    engine, traits = cfg.rollout.engine, engine_traits(cfg.rollout.engine)
    if traits.package is not None and importlib.util.find_spec(traits.package) is None:
        raise ConfigError(
            f"config error: rollout.engine: engine={engine} needs the {traits.package} package, which is not installed: "
            f"{traits.install or f'pip install {traits.package}'}, or use rollout.engine=hf"
        )
    if cfg.reward.function is not None:
        try:
            check_reward_fn(cfg.reward.function)  # an unknown name or an import path that does not resolve
        except ValueError as err:
            raise ConfigError(f"config error: reward.function: {err}") from None
    for i, tool in enumerate(cfg.agent.tools):
        for key, check in (("callable", resolve_callable), ("parameters", check_parameters_schema)):
            try:
                check(getattr(tool, key))
            except ToolConfigError as err:
                raise ConfigError(f"config error: agent.tools.{i}.{key}: {err}") from None
    if cfg.agent.enable and cfg.agent.function is not None:
        # imports torch and fastapi: only for agent-function runs
        from rlstage.engines.agents.endpoint import resolve_agent_function

        try:
            resolve_agent_function(cfg.agent.function)
        except ToolConfigError as err:
            raise ConfigError(f"config error: agent.function: {err}") from None
    if cfg.agent.enable:
        from rlstage.engines.agents.loop import check_agent_template  # imports torch: only for agent runs

        try:
            check_agent_template(cfg)
        except ToolConfigError as err:
            raise ConfigError(f"config error: agent.chat_template: {err}") from None


def check_reward_model(cfg: RunConfig) -> None:
    """The reward model is a one-label sequence classifier, or its server answers a connection."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    # Imported here: it imports torch, which a command without a reward model need not pay for.
    from rlstage.engines.rewards.reward_model import check_reward_model_path, check_server

    if rm.model.path is not None:
        problem = check_reward_model_path(rm.model.path)
        if problem is not None:
            raise ConfigError(f"config error: reward_model.model.path: {problem}")
    if rm.server.url is not None:
        key = rm.server.api_key_env
        if key is not None and not os.environ.get(key):
            raise ConfigError(f"config error: reward_model.server.api_key_env: the environment variable {key} is not set")
        problem = check_server(rm.server.url, rm.server.timeout_s)
        if problem is not None:
            raise ConfigError(f"config error: reward_model.server.url: {problem}")


def check_algorithm_names(cfg: RunConfig) -> None:
    """The estimator, loss, aggregation modes and KL penalties are registered, what the estimator needs is
    configured, and the loss's nested settings pass its settings model (engines/registry.py)."""
    from rlstage.engines import algorithms as algos
    from rlstage.engines.data import datasets  # noqa: F401  (register the built-in entries)
    from rlstage.engines.rollout import engines  # noqa: F401

    for setting, kind in CHECKED_SETTINGS.items():
        try:
            for name in named_values(cfg, setting):
                REGISTRIES[kind].entry(name)
        except ValueError as err:
            raise ConfigError(f"config error: {setting}: {err}") from None
    est, n = cfg.algorithm.adv_estimator.name, cfg.rollout.n
    needs = algos.ADV_ESTIMATORS.entry(est).needs
    if "critic" in needs and not cfg.critic.enable:
        raise ConfigError(
            f"config error: critic.enable: algorithm.adv_estimator={est} needs a critic, which is not configured"
        )
    if "groups" in needs and n < 2:
        raise ConfigError(
            f"config error: rollout.n: rollout.n={n}: algorithm.adv_estimator={est} needs groups of n >= 2"
        )
    if "sum_pi_squared" in needs and not cfg.actor.calculate_sum_pi_squared:
        raise ConfigError(
            f"config error: actor.calculate_sum_pi_squared: algorithm.adv_estimator={est} needs the old policy's sum of "
            "pi^2 over the vocabulary per token: set actor.calculate_sum_pi_squared=true (verl's name) so the "
            "old-log-prob pass returns it"
        )
    try:
        algos.policy_loss_settings(cfg.actor.policy_loss)
        algos.check_estimator_reads(cfg.algorithm)
        algos.adv_estimator_settings(cfg.algorithm.adv_estimator)
        check_flat_reads(algos.LOSS_AGG_MODES.entry(cfg.actor.loss_agg_mode), cfg.actor, FLAT_AGG_SETTINGS, "actor")
    except ValueError as err:
        raise ConfigError(f"config error: {err}") from None
    check_placement(cfg)
    check_rollout_engine(cfg)
    check_data_source(cfg)


def check_placement(cfg: RunConfig) -> None:
    """A reference/critic role placed apart has something to hold: the reference is needed for KL (in the reward or
    as a loss) or by a policy loss whose entry declares ``ref``, and a LoRA policy's reference stays on the trainer."""
    from rlstage.engines import algorithms as algos

    if cfg.ray.ref_critic_placement != "separate":
        return
    needs_ref = algos.needs_reference(cfg)
    if not (needs_ref or cfg.critic.enable):
        raise ConfigError(
            "config error: ray.ref_critic_placement: ray.ref_critic_placement=separate: this run has no reference policy "
            "(actor.use_kl_loss, algorithm.use_kl_in_reward, a policy loss that needs ref) and no critic (critic.enable) "
            "to place"
        )
    if needs_ref and cfg.model.lora:
        raise ConfigError(
            "config error: ray.ref_critic_placement: ray.ref_critic_placement=separate: with model.lora_rank > 0 the "
            "reference is the policy's own base (its adapters disabled), which lives on the trainer: keep it colocated"
        )


def check_rollout_engine(cfg: RunConfig) -> None:
    """The settings that only some rollout engines take suit the one named (what its registry entry declares)."""
    from rlstage.engines.rollout.engines import ROLLOUT_ENGINES, engine_traits

    engine, traits = cfg.rollout.engine, engine_traits(cfg.rollout.engine)
    if cfg.rollout.share_prompts and not traits.shares_prompts:
        sharing = [name for name in ROLLOUT_ENGINES if engine_traits(name).shares_prompts]
        owner = "the HF engine's" if sharing == ["hf"] else f"for rollout.engine {', '.join(sharing)}"
        raise ConfigError(
            f"config error: rollout.share_prompts: rollout.share_prompts is {owner}; rollout.engine={engine} shares a "
            "prompt's prefill through its own prefix cache"
        )
    if traits.max_lora_rank is not None and cfg.model.lora_rank > traits.max_lora_rank:
        raise ConfigError(
            f"config error: model.lora_rank: model.lora_rank={cfg.model.lora_rank}: rollout.engine={engine} serves LoRA "
            f"adapters of rank {traits.max_lora_rank} at most"
        )


def check_registered_names(cfg: RunConfig) -> None:
    """Settings that name an entry of an engine's registry (the config models, a leaf, do not import them), after
    the plugins that may register them are imported."""
    from rlstage.engines.data.datasets import ADDITION_SOURCE, GSM8K_SOURCE, MULTIPLY_SOURCE
    from rlstage.engines.data.dynamic_sampling import FILTER_METRICS
    from rlstage.engines.rewards.rules import REWARD_FNS, answer_extractor, answer_extractors, registered_fn

    load_plugins(cfg.plugins)
    check_algorithm_names(cfg)
    check_data_paths(cfg)
    for source, name in cfg.reward.by_data_source.items():
        if name not in REWARD_FNS:
            raise ConfigError(
                f"config error: reward.by_data_source.{source}: unknown reward function {name!r}; valid: {', '.join(sorted(REWARD_FNS))}"
            )
    metric = cfg.algorithm.filter_groups.metric
    if metric not in FILTER_METRICS:
        raise ConfigError(
            f"config error: algorithm.filter_groups.metric: unknown metric {metric!r}; valid: {', '.join(FILTER_METRICS)}"
        )
    if cfg.trainer.eval_require_maj:
        # a verl parquet's sources are known only from its rows: the eval stage checks those
        kit = {"addition": ADDITION_SOURCE, "multiply": MULTIPLY_SOURCE}[cfg.kit.task]
        source = {"synthetic": kit, "gsm8k": GSM8K_SOURCE}.get(cfg.data.source)
        fn = cfg.reward.function or (registered_fn(source) if source else None)
        if fn is not None and answer_extractor(fn) is None:
            where = "reward.function" if cfg.reward.function else f"the reward function of data.source={cfg.data.source},"
            raise ConfigError(
                f"config error: trainer.eval_require_maj: {where} {fn} extracts no answer for maj@N to vote on; "
                f"ones that do: {', '.join(answer_extractors())}"
            )


def check_data_paths(cfg: RunConfig) -> None:
    """A data source that reads its prompts (its registration does not declare ``generates``) is given both files:
    without a held-out set every eval would average nothing (nan), so it is refused, not defaulted."""
    from rlstage.engines.data.datasets import DATA_SOURCES, generates_prompts

    d = cfg.data
    if d.source not in DATA_SOURCES or generates_prompts(d.source):  # an unknown one: check_data_source names it
        return
    if not d.train_path:
        raise ConfigError(f"config error: data: data.train_path is required for data.source={d.source}")
    if not d.test_path:
        raise ConfigError(f"config error: data: data.test_path (the held-out set) is required for data.source={d.source}")


def check_data_source(cfg: RunConfig) -> None:
    """``data.source_settings`` pass the source's settings model, the source's package is installed, and its rows
    have a reward (a registered rule for their data_source, reward.function, or a reward model)."""
    from rlstage.engines.data import datasets
    from rlstage.engines.rewards.rules import has_rule

    load_plugins(cfg.plugins)  # a plugin's source (flows/checks.py asks before the other checks)
    try:
        source = datasets.DATA_SOURCES.entry(cfg.data.source)
        settings = settings_for(source, cfg.data.source_settings, "data.source_settings")
    except ValueError as err:
        raise ConfigError(f"config error: {err}") from None
    if isinstance(settings, datasets.ReasoningGymSettings):
        if importlib.util.find_spec("reasoning_gym") is None:
            raise ConfigError(
                "config error: data.source: data.source=reasoning_gym needs the reasoning-gym package, which is not "
                "installed: pip install 'rlstage[tasks]'"
            )
        if settings.task not in datasets.reasoning_gym_tasks():
            raise ConfigError(
                f"config error: data.source_settings.task: reasoning_gym has no task {settings.task!r}; "
                f"its tasks: {', '.join(datasets.reasoning_gym_tasks())}"
            )
    mapped = cfg.reward.by_data_source
    if isinstance(settings, datasets.ColumnSettings) and not cfg.reward_model.enable and not has_rule(settings.data_source, cfg.reward.function, mapped):
        raise ConfigError(
            f"config error: reward.function: rows of data.source={cfg.data.source} (data_source {settings.data_source!r}) "
            "have no registered reward: name one (exact_match, gsm8k_flexible, ...) or give module:function"
        )


def check_rows_have_rewards(cfg: RunConfig, sources: set[str]) -> None:
    """The rows of a source that names its own (verl's parquet), read by the caller: each ``data_source`` among them
    has a reward (reward.function, reward.by_data_source, a registered rule, or a reward model)."""
    from rlstage.engines.rewards.rules import has_rule

    if cfg.reward_model.enable or cfg.reward.function is not None:
        return
    missing = sorted(s for s in sources if not has_rule(s, None, cfg.reward.by_data_source))
    if missing:
        raise ConfigError(
            f"config error: reward.function: rows of data.source={cfg.data.source} have data_source {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} with no registered reward: map it "
            f"(reward.by_data_source={{{missing[0]}: gsm8k}}) or give reward.function (a registered name or module:function)"
        )


def preflight(cfg: RunConfig) -> None:
    """Everything a run needs from this machine, checked before any stage runs."""
    check_registered_names(cfg)
    check_model(cfg)
    check_lora(cfg)
    check_engines(cfg)
    check_reward_model(cfg)
