"""The trust allow-list: which import paths a config may name, and reading a stored config under it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlstage.schemas.config.base import ConfigError
from rlstage.schemas.config.inputs import CALCULATOR_PATHS, EXAMPLE_AGENT_PATHS, reward_function_path
from rlstage.schemas.config.loading import build_config, merge_dicts, parse_overrides
from rlstage.schemas.config.run import RunConfig

# Import paths a *stored* config may name, besides the built-in tools: the allow-list lives outside
# any store (the environment and the user's config folder), since whoever writes the store is not trusted.
ALLOWED_CALLABLES_ENV = "RLSTAGE_ALLOWED_CALLABLES"  # comma- or whitespace-separated import paths


def allowed_callables_file() -> Path:
    """``$XDG_CONFIG_HOME/rlstage/allowed_callables`` (default ``~/.config``): one import path a line, ``#`` comments."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "rlstage" / "allowed_callables"


def allowed_callables() -> set[str]:
    allowed = set(os.environ.get(ALLOWED_CALLABLES_ENV, "").replace(",", " ").split())
    try:
        text = allowed_callables_file().read_text(encoding="utf-8")
    except FileNotFoundError:
        return allowed
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config error: allow-list {allowed_callables_file()} is unreadable: {err}") from None
    return allowed | {line.split("#", 1)[0].strip() for line in text.splitlines()} - {""}


def code_settings(data: Any) -> list[tuple[str, str]]:
    """(setting, import path) for every setting of a raw config dict that names code to import."""
    data = data if isinstance(data, dict) else {}
    out = []
    reward = data.get("reward")
    fn = reward_function_path(reward.get("function")) if isinstance(reward, dict) else None
    if isinstance(fn, str) and ":" in fn:  # registered reward names hold no ':'
        out.append(("reward.function", fn))
    agent = data.get("agent")
    tools = agent.get("tools") if isinstance(agent, dict) else None
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        path = tool.get("callable") if isinstance(tool, dict) else None
        if path is not None and (":" in str(path) or "." in str(path)):  # a plain name is a registered tool
            out.append((f"agent.tools.{i}.callable", str(path)))
    function = agent.get("function") if isinstance(agent, dict) else None
    if function is not None:
        out.append(("agent.function", str(function)))
    plugins = data.get("plugins")
    for i, module in enumerate(plugins if isinstance(plugins, list) else []):
        out.append((f"plugins.{i}", str(module)))
    section = data.get("data")
    # A verifiers taskset's module is imported, and an interpreter run (overrides may name them without the source).
    verifiers = isinstance(section, dict) and section.get("source", "verifiers") == "verifiers"
    source_settings = section.get("source_settings") if verifiers else None
    for key in ("taskset", "python"):
        value = source_settings.get(key) if isinstance(source_settings, dict) else None
        if value:
            out.append((f"data.source_settings.{key}", str(value)))
    return out


def stored_config_from(stored: Any, where: str, overrides: list[str] | tuple[str, ...] = (), trusted: set[str] = frozenset()) -> RunConfig:
    """A stored config (``run.json``) plus this invocation's ``overrides``, validated.

    Code it names is imported only when this invocation names it too (in ``overrides`` or ``trusted``),
    or it is built in, or allow-listed outside the store; otherwise it is refused before validation
    (which would import it).
    """
    base = stored.get("config") if isinstance(stored, dict) else None
    if not isinstance(base, dict):
        raise ConfigError(f"config error: {where} holds no config mapping")
    given = parse_overrides(overrides)
    merged = merge_dicts(base, given)
    named = code_settings(merged)
    own = {path for _, path in code_settings(given)} | set(trusted) | set(CALCULATOR_PATHS) | set(EXAMPLE_AGENT_PATHS)
    allowed = own | (allowed_callables() if any(path not in own for _, path in named) else set())
    for setting, path in named:
        if path not in allowed:
            raise ConfigError(
                f"config error: {setting}: {path!r} comes from the stored config {where}, which may not name code "
                f"to import; give it in this command ({setting}=...) or allow it in {ALLOWED_CALLABLES_ENV} "
                f"or {allowed_callables_file()}"
            )
    return build_config(merged)
