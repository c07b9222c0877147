"""TRL's GRPOTrainer on the tiny kit: the other side of bench/vs_trl.py, run by the bench's own TRL venv.

    <trl venv>/bin/python bench/trl_grpo.py --model DIR --data DIR --seed 0 --out FILE.json

Trains from rlstage's SFT checkpoint of the kit (``--model``) on rlstage's stored train split
(``--data``: the run's ``data/data_prep`` folder) with TRL's headline settings for this task: 8 prompts
x 8 completions per step, at most 8 new tokens, lr 1e-4 decaying linearly over ``--steps``, beta 0,
one torch thread. The reward is rlstage's own ``exact_match`` (stdlib only, imported from this
checkout). Every ``--eval-every`` steps a callback scores greedy answers to the stored test split
through rlstage's own HF engine with that same function; its time is left out of the training seconds. Writes one JSON object:
``curve`` as [[training seconds, accuracy, step], ...].
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from source_tree import import_rlstage  # noqa: E402  (bench/ is this script's folder)

import_rlstage()  # the TRL venv has no rlstage installed: the checkout's own code

import pyarrow.parquet as pq  # noqa: E402  (the TRL venv has pyarrow through datasets)
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from rlstage.engines.rewards.rules import exact_match  # noqa: E402  (the criterion rlstage's reward and eval stages use)
from rlstage.engines.rollout.hf import HFRolloutEngine, SamplingParams  # noqa: E402  (the engine rlstage's eval stage uses)

MAX_NEW_TOKENS = 8
# Every bench run of TRL: on the CPU, nothing saved or reported, no progress bars.
CPU_RUN = dict(use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)


def bench_trainer(model, tok, reward, train: list[dict], callback, *, work: str, seed: int, **settings) -> GRPOTrainer:
    """TRL's GRPOTrainer as the benches run it: beta 0 (no reference model, as rlstage's side), on the CPU."""
    config = GRPOConfig(output_dir=work, seed=seed, beta=0.0, **CPU_RUN, **settings)
    return GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(train), processing_class=tok,
        callbacks=[callback],
    )  # fmt: skip


def exact_match_reward(completions: list[str], ground_truth: list[str], **_: object) -> list[float]:
    return [exact_match(c, gt, {}) for c, gt in zip(completions, ground_truth, strict=True)]


def greedy_accuracy(model, tok, prompts: list[str], answers: list[str]) -> float:
    """Greedy answers from rlstage's own HF engine (torch and transformers only), scored by its reward function."""
    params = SamplingParams(n=1, temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    comps = HFRolloutEngine(model, tok, batch_size=512).generate(prompts, params)
    return sum(exact_match(c.text, answers[c.prompt_index], {}) for c in comps) / len(answers)


class Curve(TrainerCallback):
    """Held-out accuracy every k steps against training seconds (the evals' own time subtracted).

    The trainer's model runs under accelerate's bf16 autocast on CPU (TRL's default there), so the
    greedy eval runs on an fp32 copy of its weights, as rlstage's eval stage scores its policy.
    """

    def __init__(self, model_dir: str, prompts: list[str], answers: list[str], every: int) -> None:
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.judge = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.prompts, self.answers, self.every = prompts, answers, every
        self.points: list[list[float]] = []
        self.eval_s = 0.0
        self.t0 = 0.0

    def _point(self, model, step: int) -> None:
        t = time.perf_counter()
        self.judge.load_state_dict(model.state_dict())
        acc = greedy_accuracy(self.judge, self.tok, self.prompts, self.answers)
        self.points.append([round(t - self.t0 - self.eval_s, 3), acc, step])
        self.eval_s += time.perf_counter() - t
        print(json.dumps({"step": step, "train_s": self.points[-1][0], "accuracy": acc}), flush=True)

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.t0 = time.perf_counter()
        self._point(model, 0)

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._point(model, state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the kit's SFT checkpoint (a Hugging Face model folder)")
    parser.add_argument("--data", required=True, help="the folder holding rlstage's train.parquet and test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--precision", choices=["default", "fp32"], default="default",
        help="default: TRL's (bf16 autocast where the CPU has bf16); fp32: bf16=False",
    )  # fmt: skip
    parser.add_argument("--work", default="/tmp/rlstage-trl-work", help="TRL's output_dir (nothing is saved there)")
    # bench/vs_trl.py passes the cores rlstage's config uses: both sides get the same CPU threads
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the cores rlstage's side uses)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train = pq.read_table(Path(args.data) / "train.parquet", columns=["prompt", "ground_truth"]).to_pylist()
    test = pq.read_table(Path(args.data) / "test.parquet", columns=["prompt", "ground_truth"]).to_pylist()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    curve = Curve(args.model, [r["prompt"] for r in test], [r["ground_truth"] for r in test], args.eval_every)
    trainer = bench_trainer(
        model, tok, exact_match_reward, train, curve, work=args.work, seed=args.seed,
        per_device_train_batch_size=64,  # completions: 8 prompts x num_generations
        num_generations=8, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, learning_rate=1e-4,
        lr_scheduler_type="linear", max_steps=args.steps, logging_steps=100,
        **({"bf16": False} if args.precision == "fp32" else {}),
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    result = {
        "system": "trl",
        "threads": torch.get_num_threads(),
        "version": __import__("trl").__version__,
        "seed": args.seed,
        "steps": args.steps,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "curve": curve.points,
        "train_s": curve.points[-1][0],
        "eval_s": round(curve.eval_s, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
