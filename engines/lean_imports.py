"""transformers without scikit-learn, and saving a model without DeepSpeed: ~2 CPU-s less a model-loading process.

- transformers imports ``sklearn.metrics.roc_curve`` (and SciPy) when it imports its generation code, for one
  feature only: assisted generation's adaptive confidence threshold (a draft model's), which rlstage never runs.
  While that one module executes, scikit-learn looks absent to it; everywhere else (a user's reward function,
  MLflow) it imports as usual.
- Every ``save_pretrained`` unwraps the model with accelerate's ``extract_model_from_parallel``, which imports
  DeepSpeed (and through its autotuner MLflow) to test ``isinstance(model, DeepSpeedEngine)`` whenever DeepSpeed is
  installed. No model is a DeepSpeedEngine in a process that never imported DeepSpeed, so there that check skips it
  (``actor.engine=deepspeed`` imports DeepSpeed first, and the check runs as before).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


def _without_sklearn(run: Callable[[], None], module: ModuleType) -> None:
    if "sklearn" in sys.modules:  # already paid for in this process: nothing to save
        run()
        return
    sys.modules["sklearn"] = None  # type: ignore[assignment]  # find_spec answers None, import raises
    try:
        run()
    finally:
        if sys.modules.get("sklearn", 0) is None:
            del sys.modules["sklearn"]


def _deepspeed_only_once_imported(run: Callable[[], None], module: ModuleType) -> None:
    run()
    installed = module.is_deepspeed_available
    module.is_deepspeed_available = lambda: "deepspeed" in sys.modules and installed()


# module -> how it executes
_WRAPPED: dict[str, Callable[[Callable[[], None], ModuleType], None]] = {
    "transformers.generation.candidate_generator": _without_sklearn,
    "accelerate.utils.other": _deepspeed_only_once_imported,
}


class _Wrapped(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, how: Callable[[Callable[[], None], ModuleType], None]):
        self.loader, self.how = loader, how

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.how(lambda: self.loader.exec_module(module), module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _WRAPPED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Wrapped(spec.loader, _WRAPPED[fullname])
        return spec


def install() -> None:
    """Once per process, before transformers and accelerate are imported (else it changes nothing)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
