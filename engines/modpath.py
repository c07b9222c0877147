"""Import a module named by a config's ``module:function`` path, with rlstage's earlier names.

Before 0.2.0 rlstage installed its parts as top-level packages (``engines.tools:calculator``); a config
or stored run naming them still resolves, to ``rlstage.engines...``, so its stage keys stay its own. The
modules of ``engines/`` that moved into its sub-packages in 0.2.0 resolve through ``MOVED`` (by their old
name, with or without ``rlstage.``), to their module today.
"""

from __future__ import annotations

import importlib
from types import ModuleType

LEGACY_TOP = frozenset({"schemas", "engines", "workers", "tasks", "flows", "infra"})
# rlstage.engines.<module> before 0.2.0 -> where it is now (a name a config or a stored run may hold).
MOVED: dict[str, str] = {
    f"rlstage.engines.{old}": f"rlstage.engines.{new}"
    for old, new in {
        "actor": "training.actor",
        "actor_deepspeed": "training.actor_deepspeed",
        "agent_loop": "agents.loop",
        "batching": "training.batching",
        "chat": "models.chat",
        "checkpoint": "training.checkpoint",
        "critic": "training.critic",
        "cursor": "data.cursor",
        "datasets": "data.datasets",
        "dynamic_sampling": "data.dynamic_sampling",
        "forward": "training.forward",
        "lora": "models.lora",
        "reward_model": "rewards.reward_model",
        "rewards": "rewards.rules",
        "rollout": "rollout.hf",
        "rollout_engines": "rollout.engines",
        "rollout_vllm": "rollout.vllm_engine",
        "sft": "training.sft",
        "tinykit": "models.tinykit",
        "tools": "agents.tools",
        "vllm_plugin": "rollout.vllm_plugin",
    }.items()
}


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
