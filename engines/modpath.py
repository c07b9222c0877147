"""Import a module named by a config's ``module:function`` path, with rlstage's earlier names.

Before 0.2.0 rlstage installed its parts as top-level packages (``engines.tools:calculator``); a config
or stored run naming them still resolves, to ``rlstage.engines...``, so its stage keys stay its own. The
modules of ``engines/`` that moved into its sub-packages in 0.2.0 resolve through ``MOVED`` (by their old
name, with or without ``rlstage.``), to their module today.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rlstage.schemas.config import MOVED_MODULES

LEGACY_TOP = frozenset({"schemas", "engines", "workers", "tasks", "flows", "infra"})
# rlstage.engines.<module> before 0.2.0 -> where it is now: declared with the config models, which hash the old name
MOVED = MOVED_MODULES


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``; a moved module of ours (``MOVED``) is read at its place today, and a missing
    legacy top-level package of ours as ``rlstage.<name>``."""
    if name in MOVED:  # before the import: rlstage.engines.rewards and .rollout are packages now
        return importlib.import_module(MOVED[name])
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".", 1)[0]
        if top not in LEGACY_TOP or err.name != top:
            raise
        ours = f"rlstage.{name}"
        return importlib.import_module(MOVED.get(ours, ours))
