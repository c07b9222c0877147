"""Loading a config: YAML files with dotted overrides, merged and validated into a ``RunConfig`` (one-line errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlstage.schemas.config.base import ConfigError
from rlstage.schemas.config.run import RunConfig


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: the problem and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    """``["actor.optim.lr=1e-5", ...]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config error: override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: override {key.strip()}: value is not YAML ({_yaml_problem(err)})") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def dotted(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b": value}`` (the inverse of ``parse_overrides``' nesting); an empty dict is a value."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= dotted(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def nested(flat: dict[str, Any]) -> dict:
    """``{"a.b": value}`` as a nested dict (the inverse of ``dotted``), in the keys' order of first appearance."""
    tree: dict = {}
    for key, value in flat.items():
        _set_dotted(tree, key, value)
    return tree


def merge_dicts(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def nearest_setting(key: str) -> str | None:
    """The setting a mistyped or misplaced ``key`` most likely means: one with the same last name, else the closest."""
    import difflib

    from rlstage.schemas.settings_help import setting_paths  # it imports this module

    known = setting_paths()
    paths = sorted(p for p in known if not any(q.startswith(p + ".") for q in known))  # the settings, not sections
    if "." not in key:  # a whole section: only a close section name
        close = difflib.get_close_matches(key, sorted({p.split(".", 1)[0] for p in paths}), n=1, cutoff=0.75)
        return close[0] if close else None
    leaf = key.rsplit(".", 1)[-1]
    same = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    if same:
        return max(same, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    close = difflib.get_close_matches(key, paths, n=1, cutoff=0.75)
    return close[0] if close else None


def format_validation_error(err: ValidationError) -> str:
    errors = err.errors()
    unknown = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # every unknown key at once, each with the setting it most likely means
        def named(key: str) -> str:
            near = nearest_setting(key)
            return f"{key} (did you mean {near}?)" if near else key

        near = nearest_setting(unknown[0])
        hint = f"; did you mean {near}?" if near else ""
        rest = f"; also unknown: {', '.join(named(k) for k in unknown[1:])}" if len(unknown) > 1 else ""
        return f"config error: {unknown[0]}: not a setting{hint}{rest}"
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = first["msg"].removeprefix("Value error, ")
    return f"config error: {loc}: {msg}"


def build_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config (or the defaults), apply dotted overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config error: config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"config error: config file {p} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except OSError as err:
            raise ConfigError(f"config error: config file {p} is unreadable: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config error: config file {p} is not valid YAML ({_yaml_problem(err)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config error: {p} must hold a mapping")
        data = loaded
    return build_config(merge_dicts(data, parse_overrides(overrides)))


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
