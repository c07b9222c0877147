"""Import a module named by a config's ``module:function`` path, with rlstage's names before 0.2.0.

Before 0.2.0 rlstage installed its parts as top-level packages (``engines.tools:calculator``); a config
or stored run naming them still resolves, to ``rlstage.engines.tools``, so its stage keys stay its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType

LEGACY_TOP = frozenset({"schemas", "engines", "workers", "tasks", "flows", "infra"})


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``; a missing legacy top-level package of ours is read as ``rlstage.<name>``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.split(".", 1)[0]
        if top not in LEGACY_TOP or err.name != top:
            raise
        return importlib.import_module(f"rlstage.{name}")
