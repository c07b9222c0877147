"""Third-party registrations: the environment's ``rlstage.plugins`` entry points and a config's ``plugins`` modules.

A plugin is a module whose import registers entries through the registries' decorators (``register_policy_loss``,
``register_reward_fn``, ...). Trust: plugins come from the environment (installed distributions' entry points) or
from what the user gives this command (its config or overrides); a stored config's ``plugins`` are refused unless
given again or allow-listed (schemas.config.code_settings), so a store never makes this process import code.

Provenance: an entry a config names is built in (a ``rlstage.`` module) or belongs to a plugin, identified by its
distribution and version (importlib.metadata), or by its module and the sha256 of its source when no installed
distribution provides it. A run records the plugins its names use (run.json), the stage cache keys include them
(tasks/runtime.py), and a run continued under another version, or without the plugin, is refused in one line.

Code a config names by import path (``reward.function: pkg.mod:fn``, a tool's ``callable``, ``agent.function``) is
recorded the same way (run.json ``callables``: a file or local module is hashed with the local modules it imports)
and checked the same way whenever the run continues. It stays out of
the stage cache keys: runs stored before it was recorded keep their keys, and no continuation passes the check with
another version of that code, so no committed stage is reused under it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rlstage.engines.modpath import LEGACY_TOP
from rlstage.engines.registry import NAMED_SETTINGS, REGISTRIES, DuplicateEntry, Entry, named_values
from rlstage.schemas.config import ConfigError, RunConfig, code_settings

ENTRY_POINT_GROUP = "rlstage.plugins"
_OURS = Path(__file__).resolve().parent.parent  # rlstage's package folder (the repository's root in a checkout)


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
    return module_provenance(entry.module)


def _local_roots(source: Path) -> list[Path]:
    """Where a module's local imports are looked for: its own folder, then the import path's folders that hold
    neither installed distributions, the standard library nor rlstage (their code has versions of its own)."""
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    roots = [source.parent]
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        if folder.name in ("site-packages", "dist-packages") or folder == _OURS or folder == _OURS.parent:
            continue
        if any(folder.is_relative_to(p) for p in installed) or not folder.is_dir() or folder in roots:
            continue
        roots.append(folder)
    return roots


def _imported_names(tree: ast.AST, package: list[str]) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module:
                yield module
            yield from (f"{module}.{a.name}" if module else a.name for a in node.names)


def local_sources(source: str | Path) -> list[Path]:
    """``source`` and the local modules it imports, transitively (read, never imported): a scorer's edit anywhere
    in its own files is another version of it."""
    first = Path(source).resolve()
    roots = _local_roots(first)
    found, todo = [first], [first]
    while todo:
        path = todo.pop()
        try:
            tree = ast.parse(path.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        root = next((r for r in roots if path.is_relative_to(r)), path.parent)
        package = list(path.relative_to(root).parent.parts) if path.is_relative_to(root) else []
        for name in _imported_names(tree, package):
            parts = name.split(".")
            for r in roots:
                for candidate in (r.joinpath(*parts).with_suffix(".py"), r.joinpath(*parts, "__init__.py")):
                    c = candidate.resolve()
                    if c.is_file() and c not in found and not c.is_relative_to(_OURS):
                        found.append(c)
                        todo.append(c)
    return found


def _digest(source: str | None) -> str:
    """``sha256:<12 hex>`` of a module's source and its local imports' (one file alone: that file's own hash, as
    runs recorded before local imports were followed have it)."""
    if not source:
        return "sha256:unknown"
    try:
        files = local_sources(source)
        if len(files) == 1:
            return "sha256:" + hashlib.sha256(files[0].read_bytes()).hexdigest()[:12]
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        return "sha256:" + h.hexdigest()[:12]
    except OSError:
        return "sha256:unknown"


def module_provenance(module: str) -> Plugin | None:
    """The distribution and version that provide ``module``, or the module and the hash of its source (read from the
    module loaded, else located without importing it); None for rlstage's own modules."""
    top = module.split(".")[0]
    if top == "rlstage":
        return None
    dists = _distributions().get(top)
    if dists:
        return Plugin(dists[0], metadata.version(dists[0]))
    source = getattr(sys.modules.get(module), "__file__", None)
    if source is None:
        try:  # a dotted name imports its parent packages, which the code named by a trusted config would anyway
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        source = spec.origin if spec is not None and spec.has_location else None
    return Plugin(module, _digest(source))


def callable_provenance(path: str) -> Plugin | None:
    """Where an import path a config names (``pkg.mod:fn``, a tool's ``pkg.mod.fn``, ``file.py:fn``) comes from, as
    ``module_provenance`` (a file: itself and its hash); None for rlstage's own code."""
    target = path.rsplit(":", 1)[0] if ":" in path else path.rsplit(".", 1)[0]
    if target.endswith(".py"):
        return Plugin(target, _digest(target))
    top = target.split(".")[0]
    if top in LEGACY_TOP:  # an earlier name of rlstage's own code (engines.tools:calculator), which modpath resolves
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        if spec is None or any(Path(p).resolve() == _OURS / top for p in spec.submodule_search_locations or ()):
            return None
    return module_provenance(target)


def callables_used(cfg: RunConfig) -> dict[str, str]:
    """``{distribution or module: version}`` of the code ``cfg`` names by import path (reward.function, the tools'
    callables, agent.function): recorded with a run beside its plugins (run.json ``callables``)."""
    used: dict[str, str] = {}
    for setting, path in code_settings(cfg.model_dump(mode="json")):
        origin = None if setting.startswith("plugins.") else callable_provenance(path)
        if origin is not None:
            used[origin.name] = origin.version
    return dict(sorted(used.items()))


def plugins_used(cfg: Any, settings: Iterable[str] = NAMED_SETTINGS) -> dict[str, str]:
    """``{plugin: version}`` of the entries that ``settings`` (dotted paths of ``NAMED_SETTINGS``) of ``cfg`` name."""
    used: dict[str, str] = {}
    for setting in settings:
        for name in named_values(cfg, setting):
            plugin = plugin_of(REGISTRIES[NAMED_SETTINGS[setting]].entry(name))
            if plugin is not None:
                used[plugin.name] = plugin.version
    return dict(sorted(used.items()))


def check_recorded_callables(recorded: Mapping[str, str], where: str) -> None:
    """A stored run's code named by import path (``{name: version}``, run.json ``callables``) is the same here: one
    line naming the first that differs. Not in the cache keys (runs stored before it was recorded keep theirs), so a
    continuation under other code would reuse its committed stages: refused instead."""
    for name, version in sorted(recorded.items()):
        if not version.startswith("sha256:"):  # a distribution's version
            try:
                here = metadata.version(name)
            except metadata.PackageNotFoundError:
                raise PluginError(
                    f"config error: {where} was run with {name}=={version} (its reward function or tools), which is "
                    f"not installed here: pip install '{name}=={version}'"
                ) from None
        elif name.endswith(".py"):
            here = _digest(name)
        else:
            here = (module_provenance(name) or Plugin(name, version)).version
        if here != version:
            raise PluginError(
                f"config error: {where} was run with {name} {version} (its reward function or tools), this environment "
                f"has {here}: its committed stages would be reused as they are; restore {name} {version}, or start a "
                "new run_name"
            )


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
            here = module_provenance(name)
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
