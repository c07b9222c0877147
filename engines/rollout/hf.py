"""The Hugging Face rollout engine: batched ``generate`` over the trainer's own model (``rollout.engine: hf``).

It is the dependency-free engine; vLLM's (engines/rollout/vllm_engine.py) and a plugin's implement the same
``RolloutEngine`` (engines/rollout/base.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlstage.engines.models.chat import stop_token_ids
from rlstage.engines.models.device import model_device
from rlstage.engines.rollout.base import Completion, RolloutEngine, SamplingParams


class HFRolloutEngine(RolloutEngine):
    """Batched Hugging Face ``generate`` over a model owned by the caller (shared with the trainer).

    Generation stops at any of ``stop_ids`` (eos and the chat template's end of turn); a response
    keeps its stop token, so its mask ends there.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 512, share_prompts: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.share_prompts = share_prompts
        self.stop_ids = stop_token_ids(tokenizer)

    def load_weights(self, source: str | Path | torch.nn.Module) -> float:
        """Nothing to take: this engine generates with the trainer's model object itself (``in_memory``), which an
        update has just trained. Any other weights are refused: a new engine is built for them."""
        if source is not self.model:
            raise TypeError("the HF engine generates with the model it was built on: build an engine for other weights")
        return 0.0

    @torch.no_grad()
    def generate_ids(self, encoded: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``generate`` on token ids (multi-turn rollouts continue a trajectory without re-tokenizing it)."""
        from transformers import GenerationConfig  # here: the processes that only import this module skip it

        tok = self.tokenizer
        jobs = [(i, k) for i in range(len(encoded)) for k in range(params.n)]
        greedy = params.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy or params.top_k == 0 else params.top_k,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        out: list[Completion] = []
        if params.first_prompt * params.n % self.batch_size:
            raise ValueError(f"first_prompt {params.first_prompt} x n {params.n} is not at a batch boundary ({self.batch_size})")
        first_batch = params.first_prompt * params.n // self.batch_size
        for b, start in enumerate(range(0, len(jobs), self.batch_size), start=first_batch):
            chunk = jobs[start : start + self.batch_size]
            # Left padding with its attention mask: every prompt ends where generation starts.
            batch = tok.pad(
                {"input_ids": [encoded[i] for i, _ in chunk]}, padding=True, padding_side="left", return_tensors="pt"
            ).to(model_device(self.model))
            # One seed per batch: the same config and model give the same samples on a rerun.
            torch.manual_seed(params.seed * 1_000_003 + b)
            shared = self._prefill_once(batch, [i for i, _ in chunk]) if self.share_prompts else {}
            step_logp = _step_log_probs(1.0 if greedy else params.temperature)
            res = self.model.generate(**batch, generation_config=gen_cfg, logits_processor=[step_logp], **shared)
            P = batch["input_ids"].shape[1]
            seqs = res.sequences[:, P:]
            logp = step_logp.finish(seqs)
            for row, (i, k) in enumerate(chunk):
                ids = seqs[row].tolist()
                finish = "length"
                end = next((j for j, t in enumerate(ids) if t in self.stop_ids), None)
                if end is not None:
                    ids = ids[: end + 1]
                    finish = "stop"
                out.append(
                    Completion(
                        prompt_index=params.first_prompt + i,
                        sample_index=k,
                        prompt_ids=encoded[i],
                        response_ids=ids,
                        log_probs=logp[row, : len(ids)].tolist(),
                        text=tok.decode(ids, skip_special_tokens=True),
                        finish_reason=finish,
                    )
                )
        self.model.train(was_training)
        return out

    def _prefill_once(self, batch, prompt_index: list[int]) -> dict:
        """``rollout.share_prompts``: each distinct prompt of the batch through the model once (all but its last
        token), its key/value cache indexed out to every sample of it; ``generate`` then runs only each sample's
        last prompt token and what it samples (GRPO's n samples would otherwise repeat the prompt's prefill n
        times). Nothing to share (every prompt once, or one-token prompts): an empty dict, the plain path."""
        place: dict[int, int] = {}  # prompt index -> its place among the batch's distinct prompts
        rows: list[int] = []  # the batch row of each distinct prompt's first sample
        for row, i in enumerate(prompt_index):
            if i not in place:
                place[i] = len(rows)
                rows.append(row)
        ids, mask = batch["input_ids"][:, :-1], batch["attention_mask"][:, :-1]
        if len(rows) == len(prompt_index) or ids.shape[1] == 0:
            return {}
        group = [place[i] for i in prompt_index]
        ids, mask = ids[rows], mask[rows]
        positions = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)  # as generate numbers left-padded prompts
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_select_indices(torch.as_tensor(group, device=ids.device))
        return {"past_key_values": cache}


def _step_log_probs(temperature: float):
    """A logits processor that keeps the sampled tokens' log-probs (of the logits / temperature, over the whole
    vocabulary, as verl's rollout reports them) one step at a time. ``generate``'s ``output_logits`` would keep
    every step's fp32 logits instead: B x T x V x 4 bytes, 40 GB for 64 x 512 tokens of Qwen2's vocabulary."""
    from transformers import LogitsProcessor

    class StepLogProbs(LogitsProcessor):
        def __init__(self) -> None:
            self.last: torch.Tensor | None = None  # the previous step's log-softmax, [B, V]
            self.kept: list[torch.Tensor] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            # custom processors run before the sampling warpers: ``scores`` are the raw fp32 logits
            if self.last is not None:  # input_ids now ends with the token sampled from it
                self.kept.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.last = torch.log_softmax(scores / temperature, -1)
            return scores

        def finish(self, seqs: torch.Tensor) -> torch.Tensor:
            """``[B, T]`` log-probs of the generated ``seqs``."""
            if seqs.shape[1] == 0:
                return seqs.float()
            self.kept.append(self.last.gather(-1, seqs[:, -1:]).squeeze(-1))
            return torch.stack(self.kept, dim=1)

    return StepLogProbs()
