"""LoRA policies through ``peft`` (verl's ``lora_rank`` / ``lora_alpha`` / ``target_modules``).

The trained policy is a ``PeftModel``: the base weights are frozen and only the adapters train. The
reference policy is the same module with its adapters disabled, so no second copy is held. A LoRA
checkpoint's model folder holds the adapter (``adapter_model.safetensors``, ``adapter_config.json``),
the tokenizer and ``base.json``, a reference to the base model's own checkpoint (a ``PolicyRef``);
``save_hf`` writes the base with the adapters folded in, as a plain Hugging Face folder, for rollout
engines and exports.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlstage.schemas.config import ConfigError, ModelConfig
from rlstage.schemas.manifest import PolicyRef

ADAPTER = "default"  # peft's name of the one adapter a policy holds
ADAPTER_CONFIG = "adapter_config.json"
BASE_REF = "base.json"  # the base model's PolicyRef, beside the adapter
ALL_LINEAR = "all-linear"

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
# peft is imported where a LoRA policy is built or loaded: a process without one (a command, a stage task,
# a full-weights worker) skips its ~0.7 s import.


def is_peft(model: object) -> bool:
    """Whether ``model`` is a ``PeftModel``; one exists only once peft is imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_config(cfg: ModelConfig) -> LoraConfig:
    from peft import LoraConfig

    # dropout 0: the trainer's recomputed log-probs must equal the rollout's (rollout.max_logprob_gap).
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=cfg.target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def with_adapters(model: torch.nn.Module, cfg: ModelConfig) -> PeftModel:
    """``model`` with fresh adapters (B = 0: the policy starts equal to the base); only they train."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(cfg))


def is_adapter_dir(folder: str | Path) -> bool:
    return (Path(folder) / BASE_REF).is_file()


def base_ref(folder: str | Path) -> PolicyRef:
    return PolicyRef.model_validate_json((Path(folder) / BASE_REF).read_text())


def load_adapters(base: torch.nn.Module, folder: str | Path, trainable: bool, cfg: ModelConfig | None = None) -> PeftModel:
    """A saved adapter on its (already loaded) base model; with ``cfg``, its shape must be the configured one
    (the optimizer state stored beside it fits no other)."""
    if not (Path(folder) / "adapter_model.safetensors").is_file():
        # peft would fall back to a pickled adapter_model.bin: stored bytes are never unpickled here.
        raise ValueError(f"{folder}: a LoRA checkpoint without adapter_model.safetensors is refused")
    stored = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    if cfg is not None:
        # peft stores target_modules expanded (all-linear, a regex): only a configured list compares as is.
        keys = (("lora_rank", "r"), ("lora_alpha", "lora_alpha")) + (
            (("target_modules", "target_modules"),) if isinstance(cfg.target_modules, list) else ()
        )
        for key, peft_key in keys:
            want, got = getattr(cfg, key), stored.get(peft_key)
            if (sorted(want) if isinstance(want, list) else want) != (sorted(got) if isinstance(got, list) else got):
                raise ConfigError(f"config error: model.{key}={want}, but the stored adapter in {folder} has {got}")
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder), adapter_name=ADAPTER, is_trainable=trainable)


def save_adapters(model: PeftModel, tokenizer, folder: str | Path, base: PolicyRef) -> None:
    """The adapter, the tokenizer and the base's reference: a checkpoint of a few MB for any base size."""
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # peft records the folder the base was loaded from (a scratch path): the reference names it instead, and
    # peft's model card (a template naming that folder) is left out, so a rerun or a replay commits the same bytes.
    (folder / "README.md").unlink(missing_ok=True)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    where = base.stage if base.iteration is None else f"iter-{base.iteration}/{base.stage}"
    config["base_model_name_or_path"] = base.path or f"{base.run}/{where}"
    # target_modules expanded from all-linear is a set, listed in the process's string-hash order
    config = {k: sorted(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v for k, v in config.items()}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    (folder / BASE_REF).write_text(base.model_dump_json())


def merged_state_dict(model: PeftModel, deltas: bool = True) -> dict[str, torch.Tensor]:
    """The base's state dict with each adapter's delta added to its layer (``deltas=False``: the frozen base's
    own weights); the model itself is untouched (merging in place and unmerging would leave rounding drift in
    the frozen base)."""
    inner = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for key, value in inner.state_dict().items():
        if ".lora_" not in key:
            merged[key.replace(".base_layer.", ".")] = value
    if not deltas:
        return merged
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                key = f"{name}.weight"
                merged[key] = merged[key] + module.get_delta_weight(ADAPTER).to(merged[key].dtype)
    return merged


def save_hf(model: torch.nn.Module, tokenizer, folder: str | Path, merged: bool = True) -> None:
    """A plain Hugging Face folder of a policy (a LoRA policy's merged weights, or with ``merged=False`` its
    base's, which vLLM serves the adapter over): what rollout engines and exports load."""
    if is_peft(model):
        # save_pretrained of the wrapped module would name peft's layers; the merged dict has the base's names.
        model.get_base_model().save_pretrained(folder, state_dict=merged_state_dict(model, deltas=merged))
    else:
        model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def missing_targets(model: torch.nn.Module, target_modules: list[str] | str) -> list[str]:
    """The ``target_modules`` entries matching no module of ``model`` (peft's matching: a name or a
    dotted suffix; a single string other than all-linear is a full-match regex)."""
    if target_modules == ALL_LINEAR:
        found = any(isinstance(m, torch.nn.Linear) for m in model.modules())
        return [] if found else [ALL_LINEAR]
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(target_modules, str):
        return [] if any(re.fullmatch(target_modules, n) for n in names) else [target_modules]
    return [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]


def model_skeleton(config) -> torch.nn.Module:
    """The module tree of a causal LM config, without memory for weights (for name checks)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
