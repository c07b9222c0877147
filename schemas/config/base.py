"""The config's shared pieces: its errors and warnings, the section base model, the late-settings rule of the
cache keys and the settings the other modules share."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

# The policy-loss settings that sat flat in the actor section until they nested under actor.policy_loss (0.2):
# still read for one release (with a deprecation line), and hashed in this flat form so that stored runs keep their
# cache keys (FLAT_LOSS). Their defaults are the built-in losses' (engines/algorithms/loss_registry.py reads them here).
FLAT_LOSS_SETTINGS: dict[str, Any] = {
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05,
    "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
    "dro_beta": None,
}  # fmt: skip

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def parse_is_threshold(spec: float | str) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> ``(lower, upper)``: a number is a TIS upper bound (lower None), a
    ``"lower_upper"`` string an IcePop band; both bounds must be > 0 and lower < upper."""
    if isinstance(spec, bool):
        raise ValueError("rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean")
    lower: float | None = None
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        try:
            lower, upper = float(lo), float(hi)
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not 'lower_upper' with two numbers") from None
    else:
        try:
            upper = float(spec)
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' string") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be > 0")
    if lower is not None and lower >= upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: the IcePop band needs low < high")
    return lower, upper


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key."""


class ConfigDeprecation(DeprecationWarning):
    """A setting read under its old name for one more release: the message names the new place (the CLI prints it)."""


@dataclass(frozen=True)
class FlatNames:
    """Settings of the nested section at ``path`` (actor.policy_loss, rollout.vllm) that sat flat in its parent section
    as ``prefix + name`` until they nested (0.2): still read there for one release, with a deprecation line, and hashed
    in that flat form (schemas/config/migrations.py: flat_form, hashed_paths), so that stored runs keep their cache
    keys. ``defaults``: each flat setting's default, at which a stored older config (it lists every one) says nothing."""

    path: str
    prefix: str
    defaults: dict[str, Any]

    def nest(self, data: Any) -> Any:
        """The parent section's raw mapping ``data`` with its flat settings moved into the nested section: a ValueError
        names one set both ways; anything else is returned as it is."""
        parent, _, leaf = self.path.rpartition(".")
        if not isinstance(data, dict) or not any(self.prefix + key in data for key in self.defaults):
            return data
        data = dict(data)
        nested = data.get(leaf, {})
        if isinstance(nested, BaseModel):
            nested = nested.model_dump(exclude_unset=True)
        if not isinstance(nested, dict):
            return data  # pydantic names the type it wanted
        nested = dict(nested)
        for key, default in self.defaults.items():
            old = self.prefix + key
            if old not in data:
                continue
            value = data.pop(old)
            if value == default:
                continue
            if key in nested:
                raise ValueError(
                    f"{parent}.{old} (deprecated) and {self.path}.{key} are both set: keep the second"
                )
            warnings.warn(
                f"{parent}.{old} is deprecated: set {self.path}.{key} (the flat name is read until 0.3)",
                ConfigDeprecation,
                stacklevel=2,
            )
            nested[key] = value
        data[leaf] = nested
        return data

    def flatten(self, section: dict, nested: dict) -> None:
        """Move each setting of ``nested`` (the nested section's dump) that has a flat name back into ``section`` (its
        parent's) under that name, in place; a setting added since stays nested."""
        for key in self.defaults:
            if key in nested:
                section[self.prefix + key] = nested.pop(key)


FLAT_LOSS = FlatNames("actor.policy_loss", "", FLAT_LOSS_SETTINGS)


# A setting added after runs were stored: cache keys hash it only when it differs from its default, so the stages
# those runs committed keep their keys (a nightly after an upgrade continues them instead of redoing them).
HASHED_WHEN_SET = {"hashed_when_set": True}


def _default(field: Any) -> Any:
    return field.get_default(call_default_factory=True)


def drop_unset_late_settings(model: type[BaseModel], dump: dict) -> dict:
    """Remove from ``dump`` (a ``model_dump(mode="json")`` of ``model``, or part of one) every late setting at its
    default, in place; ``dump`` for chaining. A config recorded before such a setting existed then equals one
    that leaves it unset."""
    for name, field in model.model_fields.items():
        if name not in dump:
            continue
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel) and isinstance(dump[name], dict):
            drop_unset_late_settings(section, dump[name])
        elif (field.json_schema_extra or {}).get("hashed_when_set") and dump[name] == _default(field):
            del dump[name]
    return dump


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def absolute_root(root: str) -> str:
    """A local store root as an absolute path (a URL as it is): the workers of a Ray cluster that the run joins
    run in the cluster's directories and would resolve a relative one there."""
    if "://" in root and not root.startswith("file://"):
        return root
    scheme = "file://" if root.startswith("file://") else ""
    return scheme + os.path.abspath(os.path.expanduser(root.removeprefix("file://")))
