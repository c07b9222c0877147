"""The rollout engines a config names (``rollout.engine``): a registry of factories.

A factory ``fn(cfg, model, tokenizer, path, current=None) -> engine`` builds the engine for policy weights just
loaded, ``model`` holding them in memory and ``path`` a folder of them; ``current`` is the engine the worker holds
(a running one may take the new weights in place). The engine has ``HFRolloutEngine``'s ``generate`` contract
(engines/rollout/hf.py). ``hf`` shares ``model``; every other engine, a plugin's too, starts from the folder of plain
weights (workers/rollout.py merges a LoRA checkpoint into one for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlstage.engines.models.lora import is_peft
from rlstage.engines.registry import Registry

EngineFactory = Callable[..., Any]
ROLLOUT_ENGINES: Registry[EngineFactory] = Registry("rollout engine")
IN_MEMORY = "hf"  # the engine that generates with the trainer's own model object


def register_rollout_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: register a rollout engine's factory under ``name`` (a ``rollout.engine``)."""
    return ROLLOUT_ENGINES.register(name)


@register_rollout_engine("hf")
def hf_engine(cfg: Any, model: Any, tokenizer: Any, path: str, current: Any = None) -> Any:
    """HF ``generate`` on ``model`` itself."""
    from rlstage.engines.rollout.hf import HFRolloutEngine

    r = cfg.rollout
    return HFRolloutEngine(model, tokenizer, r.batch_size, r.share_prompts)


@register_rollout_engine("vllm")
def vllm_engine(cfg: Any, model: Any, tokenizer: Any, path: str, current: Any = None) -> Any:
    """A running vLLM engine (``current``) takes the new weights in place: starting one costs 15-60 s on CPU. A
    LoRA policy held in memory (a ``PeftModel``, colocated) reaches vLLM as its adapter over the base's weights in
    ``path`` (vLLM's LoRA support, as verl's LoRA rollout); a folder of merged weights is loaded as it is."""
    from rlstage.engines.rollout.vllm_engine import VLLMRolloutEngine  # lazy: vllm is an optional extra

    r = cfg.rollout
    adapter = is_peft(model)
    if not isinstance(current, VLLMRolloutEngine):
        current = VLLMRolloutEngine(
            path,
            tokenizer,
            dtype=cfg.model.dtype,
            seed=r.seed,
            kv_cache_bytes=r.vllm_kv_cache_bytes,
            enforce_eager=r.vllm_enforce_eager,
            max_num_seqs=r.vllm_max_num_seqs,
            cpu_threads_bind=r.vllm_cpu_threads_bind,
            quiet_waits=r.vllm_quiet_waits,
            lora_rank=cfg.model.lora_rank if adapter else 0,
        )
    else:
        current.load_weights(path)
    if adapter:
        current.load_adapter(model)
    return current
