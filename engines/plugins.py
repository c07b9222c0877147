"""Third-party registrations: the environment's ``rlstage.plugins`` entry points and a config's ``plugins`` modules.

A plugin is a module whose import registers entries through the registries' decorators (``register_policy_loss``,
``register_reward_fn``, ...). Trust: plugins come from the environment (installed distributions' entry points) or
from what the user gives this command (its config or overrides); a stored config's ``plugins`` are refused unless
given again or allow-listed (schemas.config.code_settings), so a store never makes this process import code.

Provenance: an entry a config names is built in (a ``rlstage.`` module) or belongs to a plugin, identified by its
distribution and version (importlib.metadata), or by its module and the sha256 of its source when no installed
distribution provides it. A run records the plugins its names use (run.json), the stage cache keys include them
(tasks/runtime.py), and a run continued under another version, or without the plugin, is refused in one line.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from rlstage.engines.registry import NAMED_SETTINGS, REGISTRIES, DuplicateEntry, Entry, named_values
from rlstage.schemas.config import ConfigError

ENTRY_POINT_GROUP = "rlstage.plugins"


class PluginError(ConfigError):
    """A plugin that fails to import, registers a taken name, or differs from the one a stored run used."""


@dataclass(frozen=True)
class Plugin:
    name: str  # the distribution's name, or the module's where no distribution provides it
    version: str  # the distribution's version, or "sha256:<12 hex>" of the module's source


_IMPORTED: set[str] = set()


def _import(module: str, where: str) -> None:
    if module in _IMPORTED:
        return
    try:
        importlib.import_module(module)
    except DuplicateEntry as err:
        raise PluginError(f"config error: {where}: plugin {module!r}: {err}") from None
    except Exception as err:  # a plugin's own failure, whatever it is, is reported in one line
        problem = " ".join(str(err).split())
        raise PluginError(
            f"config error: {where}: plugin {module!r} failed to import: {type(err).__name__}: {problem}"
        ) from None
    _IMPORTED.add(module)


def load_plugins(modules: Sequence[str] = ()) -> None:
    """Import the environment's ``rlstage.plugins`` entry points, then ``modules`` (a config's ``plugins``), each once
    per process. PluginError (one line, naming the entry point or ``plugins.<i>``) when one fails to import or
    registers a name that is taken."""
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.value, e.name)):
        dist = ep.dist.name if ep.dist is not None else "?"
        _import(ep.module, f"entry point {ENTRY_POINT_GROUP}:{ep.name} of {dist}")
    for i, module in enumerate(modules):
        _import(module, f"plugins.{i}")


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    # import name -> the distributions providing it: a scan of every installed one, done once a process
    return metadata.packages_distributions()


def plugin_of(entry: Entry) -> Plugin | None:
    """The plugin an entry comes from; None for a built-in one."""
    if entry.module == "rlstage" or entry.module.startswith("rlstage."):
        return None
    top = entry.module.split(".")[0]
    dists = _distributions().get(top)
    if dists:
        return Plugin(dists[0], metadata.version(dists[0]))
    source = getattr(sys.modules.get(entry.module), "__file__", None)
    digest = hashlib.sha256(open(source, "rb").read()).hexdigest()[:12] if source else "unknown"
    return Plugin(entry.module, f"sha256:{digest}")


def plugins_used(cfg: Any, settings: Iterable[str] = NAMED_SETTINGS) -> dict[str, str]:
    """``{plugin: version}`` of the entries that ``settings`` (dotted paths of ``NAMED_SETTINGS``) of ``cfg`` name."""
    used: dict[str, str] = {}
    for setting in settings:
        for name in named_values(cfg, setting):
            plugin = plugin_of(REGISTRIES[NAMED_SETTINGS[setting]].entry(name))
            if plugin is not None:
                used[plugin.name] = plugin.version
    return dict(sorted(used.items()))


def check_recorded_plugins(recorded: Mapping[str, str], where: str) -> None:
    """A stored run's plugins (``{name: version}``) are the ones here: one line naming the first that is not."""
    for name, version in sorted(recorded.items()):
        if version.startswith("sha256:"):
            module = sys.modules.get(name)
            if module is None:
                raise PluginError(
                    f"config error: {where} was run with plugin module {name} ({version}), which is not loaded here: "
                    "name it in plugins (or install the distribution that registers it)"
                )
            here = plugin_of(Entry(name, None, module=name))
        else:
            try:
                here = Plugin(name, metadata.version(name))
            except metadata.PackageNotFoundError:
                raise PluginError(
                    f"config error: {where} was run with plugin {name}=={version}, which is not installed here: "
                    f"pip install '{name}=={version}'"
                ) from None
        if here is not None and here.version != version:
            raise PluginError(
                f"config error: {where} was run with plugin {name} {version}, this environment has {here.version}: its "
                f"stages would not be reused; install {name} {version} again, or start a new run_name"
            )
