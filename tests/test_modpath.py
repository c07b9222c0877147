"""Import paths written before 0.2.0 (``engines.tools:calculator``) resolve to ``rlstage.engines``; others do not.

Checked in a process outside the source tree: from the repository root, ``engines`` is the folder itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import pytest
from rlstage.engines import tools
from rlstage.engines.modpath import import_module
from rlstage.engines.rewards import score_batch
from rlstage.engines.tools import ToolConfigError, resolve_callable

assert resolve_callable("engines.tools:calculator") is tools.calculator
assert resolve_callable("rlstage.engines.tools:calculator") is tools.calculator
assert import_module("engines.tools") is tools
row = {"response_text": "ok", "ground_truth": "ok", "data_source": "x", "extra_info": "{}"}
assert score_batch([row], timeout_s=2.0, function="engines.rewards:exact_match")[0].score == 1.0
with pytest.raises(ToolConfigError, match="cannot import 'no_such_pkg.mod:fn'"):
    resolve_callable("no_such_pkg.mod:fn")
with pytest.raises(ModuleNotFoundError, match="rlstage.engines.no_such"):
    import_module("engines.no_such")  # ours, but no such module: the error names the real place
print("ok")
"""


def test_legacy_paths_of_ours_resolve_to_the_package(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
