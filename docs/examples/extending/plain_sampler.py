"""A rollout engine: token-by-token sampling with the trainer's own model, each sample seeded by its prompt.

``rollout.engine: plain_sampler``. It shows the whole ``RolloutEngine`` contract: ``generate_ids`` returns ``n``
completions a prompt with their sampling log-probs, and ``load_weights`` has nothing to do for an engine that
generates with the trainer's model (``EngineTraits(in_memory=True)``). No key/value cache: a teaching engine.
"""

from __future__ import annotations

import torch

from rlstage.engines.models.chat import stop_token_ids
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams
from rlstage.engines.rollout.engines import EngineTraits, register_rollout_engine


class PlainSampler(RolloutEngine):
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stops = set(stop_token_ids(tokenizer))

    @torch.no_grad()
    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.top_p < 1.0 or params.top_k > 0:
            raise ValueError("plain_sampler samples the whole vocabulary: set rollout.top_p=1 and rollout.top_k=0")
        # log-probs at the sampling temperature, as the trainer recomputes them (greedy: at temperature 1)
        temperature = params.temperature or 1.0
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        out = []
        for i, prompt in enumerate(encoded):
            index = params.first_prompt + i  # the prompt's place in the whole batch: its seed wherever it runs
            for k in range(params.n):
                generator = torch.Generator().manual_seed(params.seed * 1_000_003 + index * 1_009 + k)
                ids, log_probs, finish = list(prompt), [], "length"
                for _ in range(params.max_new_tokens):
                    logits = self.model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    if params.temperature == 0:
                        token = int(logp.argmax())
                    else:
                        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                    ids.append(token)
                    log_probs.append(float(logp[token]))
                    if token in self.stops:  # the response keeps the token that ended it
                        finish = "stop"
                        break
                response = ids[len(prompt) :]
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                out.append(Completion(index, k, list(prompt), response, log_probs, text, finish))
        self.model.train(was_training)
        return out

    def load_weights(self, source) -> float:
        return 0.0  # it generates with the trainer's model itself: its weights are the update's already


@register_rollout_engine("plain_sampler", traits=EngineTraits(in_memory=True))
def plain_sampler(cfg, model, tokenizer, path, current=None) -> RolloutEngine:
    """Build the engine for the worker: ``model`` is the trainer's, ``path`` its weights' folder (unused here)."""
    return PlainSampler(model, tokenizer)
