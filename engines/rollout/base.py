"""What every rollout engine is: ``RolloutEngine``, and the records it takes and returns (``SamplingParams``,
``Completion``).

The workers hold an engine only through this interface, so what an engine can do is its type's, never found by
probing it: it generates (``generate`` / ``generate_ids``), takes an update's weights (``load_weights``) and
releases what it holds (``close``). What the config checks and the workers must know before one is built (it
shares the trainer's model, seeds per batch, its largest LoRA rank) is its registry entry's ``EngineTraits``
(engines/rollout/engines.py). As verl's rollouts subclass ``verl/workers/rollout/base.py``.

``SamplingParams`` and ``Completion`` are plain dataclasses: Ray pickles them, so they cross the workers'
boundary as they are, and stages read completions by attribute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    seed: int = 0
    # The index of the first prompt in the whole batch: seeds and prompt indices follow it, so a batch split
    # over rollout workers samples as it would in one (HF: split at multiples of its batch of prompts).
    first_prompt: int = 0


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str  # "stop" when a stop token (eos, the template's end of turn) was sampled, else "length"


class RolloutEngine(ABC):
    """A rollout engine: ``n`` sampled responses per prompt with their sampling log-probs.

    A subclass implements ``generate_ids`` and ``load_weights``; ``generate`` (text prompts) and ``close`` have
    defaults. Its registry factory (``register_rollout_engine``) builds it; the worker refuses anything else.
    """

    tokenizer: Any  # the policy's: ``generate`` encodes with it, the agent loop renders turns with it
    # the most requests one ``generate_ids`` call serves at once: the agent loop gathers concurrent turns up to it
    batch_size: int = 1024

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """``generate_ids`` on text prompts, encoded as they stand (no special tokens added)."""
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self.generate_ids(encoded, params)

    @abstractmethod
    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions of each prompt of token ids, prompt by prompt, sample by sample; prompt indices
        (and the seeds) start at ``params.first_prompt``. A response keeps the stop token that ended it."""

    @abstractmethod
    def load_weights(self, source: str | Path | torch.nn.Module) -> float:
        """Take an update's policy weights (a Hugging Face folder, or the trainer's model in memory); the seconds it
        took. An engine that generates with the trainer's own model (``EngineTraits.in_memory``) has them already."""

    def close(self) -> None:  # noqa: B027  (a default: an engine that holds nothing has nothing to release)
        """Release what the engine holds (processes, shared memory, files); the worker calls it before it goes."""


INTERFACE = ("generate", "generate_ids", "load_weights", "close")  # what a worker calls on an engine


def check_engine(name: str, engine: object) -> RolloutEngine:
    """``engine`` as the ``RolloutEngine`` that the factory of ``rollout.engine`` ``name`` built; a TypeError of one
    line naming what it lacks otherwise (a plugin's factory returning something else)."""
    if isinstance(engine, RolloutEngine):
        return engine
    lacks = [m for m in INTERFACE if m not in dir(engine)]
    what = f"it lacks {', '.join(lacks)}" if lacks else "subclass it"
    raise TypeError(
        f"rollout.engine={name}: its factory returned a {type(engine).__name__}, not a RolloutEngine "
        f"(rlstage.engines.rollout.base): {what}"
    )
