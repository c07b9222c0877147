"""transformers without scikit-learn: a model-loading process saves ~1 s of CPU (scikit-learn, SciPy).

transformers imports ``sklearn.metrics.roc_curve`` when it imports its generation code, for one feature only:
assisted generation's adaptive confidence threshold (a draft model's), which rlstage never runs. Every process
that loads a model (each policy, rollout and reward-model worker, each stage task) paid for it. While that one
module executes, scikit-learn looks absent to it; everywhere else (a user's reward function, MLflow) it imports
as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_MODULE = "transformers.generation.candidate_generator"


class _WithoutSklearn(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if "sklearn" in sys.modules:  # already paid for in this process: nothing to save
            self.loader.exec_module(module)
            return
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # find_spec answers None, import raises
        try:
            self.loader.exec_module(module)
        finally:
            if sys.modules.get("sklearn", 0) is None:
                del sys.modules["sklearn"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutSklearn(spec.loader)
        return spec


def install() -> None:
    """Once per process, before transformers' generation code is imported (else it changes nothing)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
