"""Reading configs written by older releases: moved module paths, plain entry names and the flat settings (of the policy
loss and of vLLM)."""

from __future__ import annotations

from typing import Any

from rlstage.schemas.config.base import FLAT_LOSS, FLAT_LOSS_SETTINGS
from rlstage.schemas.config.inputs import FLAT_VLLM

# rlstage.engines.<module> before 0.2.0 -> where it is now (engines/modpath.py imports by either; a config naming
# the new place hashes as one naming the old, so runs stored before 0.2.0 keep their keys: legacy_callables).
MOVED_MODULES: dict[str, str] = {
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
_MOVED_BACK = {new: old for old, new in MOVED_MODULES.items()}


def legacy_callables(dump: dict) -> dict:
    """``dump`` with each ``module:function`` of a moved module (reward.function, agent.tools' callables) named by
    its module's name before 0.2.0, in place: a shipped config that names the new place keeps the keys of a run it
    started before the move."""

    def back(path: Any) -> Any:
        if not isinstance(path, str) or ":" not in path:
            return path
        module, _, fn = path.partition(":")
        return f"{_MOVED_BACK[module]}:{fn}" if module in _MOVED_BACK else path

    reward = dump.get("reward")
    if isinstance(reward, dict):
        reward["function"] = back(reward.get("function"))
    agent = dump.get("agent")
    if isinstance(agent, dict):
        for tool in agent.get("tools") or []:
            if isinstance(tool, dict):
                tool["callable"] = back(tool.get("callable"))
    return dump


# Named entries that 0.1 stored as a plain name and 0.2 nests as {name, settings...}: hashed as that plain name when
# given no settings, so a run stored before keeps its keys (actor.policy_loss: flat_loss_form).
NAMED_ENTRY_PATHS = ("algorithm.adv_estimator",)


def plain_entry_names(dump: dict) -> dict:
    """``dump`` (a run config's json dump) with each ``NAMED_ENTRY_PATHS`` section that holds only a name as that name,
    in place: ``{"name": "grpo"}`` hashes as ``"grpo"``, as 0.1 stored it."""
    for path in NAMED_ENTRY_PATHS:
        *parents, leaf = path.split(".")
        node = dump
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        entry = node.get(leaf) if isinstance(node, dict) else None
        if isinstance(entry, dict) and set(entry) == {"name"}:
            node[leaf] = entry["name"]
    return dump


# The nested sections whose settings had flat names (schemas.config.base.FlatNames), and each such setting's path ->
# its flat name's path (rollout.vllm.block_size -> rollout.vllm_block_size), which the hashed form holds.
FLAT_NAMES = (FLAT_LOSS, FLAT_VLLM)
FLAT_PATHS = {
    f"{names.path}.{key}": f"{names.path.rpartition('.')[0]}.{names.prefix}{key}"
    for names in FLAT_NAMES
    for key in names.defaults
}


def flat_loss_form(dump: dict) -> dict:
    """``dump`` (a run config's json dump) with ``actor.policy_loss`` as 0.1 stored it, in place: the loss's name as a
    string and every flat loss setting beside it, given or at its default. Cache keys and run identities hash this
    form, so a run stored before the settings nested keeps its keys; settings without a flat name stay nested."""
    actor = dump.get("actor")
    if isinstance(actor, dict) and isinstance(actor.get("policy_loss"), dict):
        loss = {**FLAT_LOSS_SETTINGS, **actor["policy_loss"]}
        name = loss.pop("name")
        FLAT_LOSS.flatten(actor, loss)
        actor["policy_loss"] = {"name": name, **loss} if loss else name
    return dump


def flat_form(dump: dict) -> dict:
    """``dump`` (a run config's json dump) with every setting that had a flat name under that name, in place: the policy
    loss as 0.1 stored it (flat_loss_form) and ``rollout.vllm``'s settings as ``rollout.vllm_<name>`` (its section
    left out when nothing else is in it). Cache keys, run identities and tracked params use this form."""
    rollout = dump.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("vllm"), dict):
        vllm = rollout.pop("vllm")
        FLAT_VLLM.flatten(rollout, vllm)
        if vllm:
            rollout["vllm"] = vllm
    return flat_loss_form(dump)


def hashed_paths(path: str) -> tuple[str, ...]:
    """Where the dotted setting or section ``path`` is in the hashed form (flat_form): a nested setting that had a flat
    name under that name, its section under all of them and its own path (for settings without one)."""
    if path in FLAT_PATHS:
        return (FLAT_PATHS[path],)
    if any(path == names.path for names in FLAT_NAMES):
        return (path, *(flat for nested, flat in FLAT_PATHS.items() if nested.startswith(path + ".")))
    return (path,)
