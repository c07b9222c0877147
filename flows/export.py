"""``rlstage export``: a stored policy as a plain Hugging Face folder (a LoRA checkpoint merged into its base)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from rlstage.engines.models.lora import save_hf
from rlstage.flows.checks import check_eval, stored_config_with
from rlstage.flows.replay import stored_inputs
from rlstage.flows.retention import stored_checkpoints
from rlstage.schemas.config import ConfigError
from rlstage.workers.policy import fetch_model, load_policy_model


def export_policy(store_root: str, run: str, iteration: int | None, out: str | Path) -> dict:
    """Write the policy after update ``iteration`` (default: the last; 0: the start) into ``out``."""
    store, cfg = stored_config_with(store_root, run, [], "an export")
    iteration = check_eval(store, run, iteration)
    policy = stored_inputs(cfg, store, "eval", iteration)["policy"]  # the policy the eval of that iteration scores
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"config error: --out {out} exists and is not empty")
    if policy.path is None:
        manifest = store.manifest(policy.run, policy.iteration, policy.stage)
        if manifest is not None and manifest.meta.get("between_checkpoints"):
            why = (
                f"was pruned (trainer.max_actor_ckpt_to_keep={cfg.trainer.max_actor_ckpt_to_keep})"
                if manifest.meta.get("pruned")
                else f"lies between checkpoints (trainer.checkpoint_every={cfg.trainer.checkpoint_every})"
            )
            stored = ", ".join(map(str, stored_checkpoints(store, run))) or "none"
            raise ConfigError(
                f"config error: iteration: the policy of iteration {iteration} {why}; "
                f"iterations with stored weights: {stored} (eval and replay rebuild the others)"
            )
    with tempfile.TemporaryDirectory(prefix="rlstage-export-") as tmp:
        folder = fetch_model(store, policy, Path(tmp) / "model")
        model, base = load_policy_model(cfg, store, policy, folder, Path(tmp), trainable=False)
        save_hf(model, AutoTokenizer.from_pretrained(folder), out)
    return {"run": run, "iteration": iteration, "policy": policy.version, "merged": base is not None, "out": str(out)}
