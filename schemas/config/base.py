"""The config's shared pieces: its errors and warnings, the section base model, the late-settings rule of the
cache keys and the settings the other modules share."""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

# The policy-loss settings that sat flat in the actor section until they nested under actor.policy_loss (0.2):
# still read for one release (with a deprecation line), and hashed in this flat form so that stored runs keep their
# cache keys. Their defaults are the built-in losses' (engines/algorithms/loss_registry.py reads them from here).
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
