"""TRL's GRPOTrainer on SmolLM2-135M-Instruct and GSM8K, timed step by step: the other side of
bench/vs_trl_real.py, run by the bench's own TRL venv.

    <trl venv>/bin/python bench/trl_gsm8k_steps.py --model DIR --train FILE.jsonl --steps 6 --out FILE.json

The batch shapes of ``configs/gsm8k-smollm2.yaml``: one generation of 4 prompts x 8 completions
(``generation_batch_size`` 32) serves two optimizer steps of 16 completions (``steps_per_generation`` 2),
at most 256 new tokens, temperature 1, lr 2e-5 constant, beta 0, fp32, two torch threads. Prompts: GSM8K
train questions with verl's instruction as chat messages (TRL renders the model's chat template); the
reward is rlstage's own ``gsm8k`` scorer (verl's rules) with format score 0.1. Writes one JSON object:
seconds and completion tokens of every optimizer step (a step that generates carries its generation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from source_tree import import_rlstage  # noqa: E402  (bench/ is this script's folder)

import_rlstage()  # the TRL venv has no rlstage installed: the checkout's own code

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_grpo import CPU_RUN  # noqa: E402

from rlstage.engines.data.datasets import load_gsm8k  # noqa: E402  (rlstage's GSM8K prompts: verl's instruction)
from rlstage.engines.rewards.rules import gsm8k  # noqa: E402  (the scorer rlstage's reward stage runs)

PROMPTS, SAMPLES, MINI_BATCH, MAX_NEW_TOKENS = 4, 8, 16, 256


class Tokens:
    """The reward function: verl's gsm8k score with a format score, counting completion tokens on the way."""

    __name__ = "gsm8k"

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, completions: list, ground_truth: list[str], completion_ids: list, **_: object) -> list[float]:
        self.count += sum(len(ids) for ids in completion_ids)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: messages
        return [gsm8k(t, gt, {}, format_score=0.1) for t, gt in zip(texts, ground_truth, strict=True)]


class StepClock(TrainerCallback):
    def __init__(self, tokens: Tokens) -> None:
        self.tokens, self.steps, self._t, self._n = tokens, [], 0.0, 0

    def on_step_begin(self, args, state, control, **kw):
        self._t, self._n = time.perf_counter(), self.tokens.count

    def on_step_end(self, args, state, control, **kw):
        self.steps.append({"step": state.global_step, "seconds": round(time.perf_counter() - self._t, 3),
                           "completion_tokens": self.tokens.count - self._n})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--train", required=True, help="GSM8K train.jsonl")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (two per generation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/rlstage-trl-work", help="TRL's output_dir (nothing is saved there)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    rows = load_gsm8k(args.train).to_pylist()
    train = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    reward = Tokens()
    clock = StepClock(reward)
    config = GRPOConfig(
        output_dir=args.work,
        per_device_train_batch_size=MINI_BATCH,
        num_generations=SAMPLES,
        generation_batch_size=PROMPTS * SAMPLES,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        beta=0.0,
        seed=args.seed,
        bf16=False,
        logging_steps=1,
        **CPU_RUN,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=train, processing_class=tok, callbacks=[clock]
    )
    t0 = time.perf_counter()
    trainer.train()
    result = {
        "system": "trl",
        "version": __import__("trl").__version__,
        "steps_per_generation": trainer.args.steps_per_generation,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "steps": clock.steps,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
