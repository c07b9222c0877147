"""Import paths written before 0.2.0 (``engines.tools:calculator``) resolve to ``rlstage.engines``, and so do the
modules of ``engines/`` before it had sub-packages (``rlstage.engines.tools:calculator``); others do not.

Checked in a process outside the source tree: from the repository root, ``engines`` is the folder itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import importlib, importlib.util
import pytest
from rlstage.engines.agents import tools
from rlstage.engines.modpath import MOVED, import_module
from rlstage.engines.rewards.rules import exact_match, score_batch
from rlstage.engines.agents.tools import ToolConfigError, resolve_callable

for path in ("engines.tools:calculator", "rlstage.engines.tools:calculator", "rlstage.engines.tools.calculator",
             "engines.tools.calculator", "rlstage.engines.agents.tools:calculator", "calculator"):
    assert resolve_callable(path) is tools.calculator, path
assert import_module("engines.tools") is tools
row = {"response_text": "ok", "ground_truth": "ok", "data_source": "x", "extra_info": "{}"}
for fn in ("engines.rewards:exact_match", "rlstage.engines.rewards:exact_match", "rlstage.engines.rewards.rules:exact_match"):
    assert score_batch([row], timeout_s=2.0, function=fn)[0].score == 1.0, fn
# every moved module resolves by its old name, with or without rlstage., to its module today; no shim holds the old one
for old, new in MOVED.items():
    module = importlib.import_module(new)
    assert import_module(old) is module and import_module(old.removeprefix("rlstage.")) is module, old
    spec = importlib.util.find_spec(old)
    assert spec is None or spec.submodule_search_locations is not None, f"{old} is still a module"
with pytest.raises(ToolConfigError, match="cannot import 'no_such_pkg.mod:fn'"):
    resolve_callable("no_such_pkg.mod:fn")
with pytest.raises(ModuleNotFoundError, match="rlstage.engines.no_such"):
    import_module("engines.no_such")  # ours, but no such module: the error names the real place
print("ok")
"""


def test_legacy_paths_of_ours_resolve_to_the_package(tmp_path):
    # no PYTHONPATH entry that holds the source tree's top-level folders (``engines`` would import as itself)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "engines").is_dir()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": os.pathsep.join(paths)} if paths else {})
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_config_naming_a_moved_module_hashes_as_one_naming_its_old_place() -> None:
    """configs/agent_calc.yaml names rlstage.engines.agents.tools:calculator since 0.2.0; a run it started before
    (rlstage.engines.tools:calculator) keeps its keys and identity."""
    from rlstage.schemas.config import build_config, load_config

    base = load_config("configs/agent_calc.yaml")
    assert base.agent.tools[0].callable == "rlstage.engines.agents.tools:calculator"
    dumped = base.model_dump(mode="json")
    dumped["agent"]["tools"][0]["callable"] = "rlstage.engines.tools:calculator"
    before = build_config(dumped)
    assert base.hashed_dump() == before.hashed_dump()
    assert base.stage_hash("agent") == before.stage_hash("agent")
    assert base.hashed_dump()["agent"]["tools"][0]["callable"] == "rlstage.engines.tools:calculator"
