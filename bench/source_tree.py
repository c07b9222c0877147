"""Make ``rlstage`` importable from this checkout where it is not installed (the TRL benches' own venv).

The repository root is the ``rlstage`` package (pyproject.toml's package-dir); registering it under that
name lets ``import rlstage.engines.rewards.rules`` find ``engines/rewards/rules.py`` as the installed package would.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_rlstage() -> None:
    try:
        import rlstage  # noqa: F401  installed (this checkout's editable install, or a wheel)

        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("rlstage", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlstage"] = module
    spec.loader.exec_module(module)
