"""Which task can a small model learn? Its greedy held-out accuracy on reasoning-gym candidates (docs/data.md).

    .venv/bin/python bench/task_probe.py "$(.venv/bin/python -m rlstage.infra.models smollm2)" --n 100

Each candidate: ``n`` prompts generated with a fixed seed, the model's chat template with "Give only the final
answer." appended, greedy decoding of ``--max-new-tokens``, and the task's own checker on the answer's last number
(rlstage's ``reasoning_gym`` reward does the same). One JSON line per candidate; GSM8K's one-step questions last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rlstage.engines.rewards.rules import reasoning_gym_answer

CANDIDATES = [
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2}),
    ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20}),
    ("count_bits", {"min_n": 1, "max_n": 16}),
    ("letter_counting", {"min_words": 3, "max_words": 5}),
]
GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def greedy(model, tok, questions: list[str], max_new_tokens: int, batch: int = 25) -> list[tuple[str, int]]:
    """Each question's greedy answer through the chat template, and its length in tokens."""
    out = []
    for i in range(0, len(questions), batch):
        texts = [
            tok.apply_chat_template([{"role": "user", "content": f"{q} Give only the final answer."}], tokenize=False, add_generation_prompt=True)
            for q in questions[i : i + batch]
        ]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row in ids[:, enc.input_ids.shape[1] :]:
            out.append((tok.decode(row, skip_special_tokens=True), int((row != tok.pad_token_id).sum())))
    return out


def main(argv: list[str] | None = None) -> int:
    import reasoning_gym
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model folder")
    parser.add_argument("--n", type=int, default=100, help="prompts per candidate")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy answer length limit")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for task, config in CANDIDATES:
        t0 = time.monotonic()
        entries = list(reasoning_gym.create_dataset(task, size=args.n, seed=12345, **config))
        answers = greedy(model, tok, [e["question"] for e in entries], args.max_new_tokens)
        score = reasoning_gym.get_score_answer_fn(task)
        correct = sum(score(reasoning_gym_answer(text), e) >= 1.0 for (text, _), e in zip(answers, entries, strict=True))
        row = {"task": task, "config": config, "n": args.n, "accuracy": correct / args.n,
               "mean_answer_tokens": round(sum(n for _, n in answers) / args.n, 1), "seconds": round(time.monotonic() - t0, 1),
               "example": [entries[0]["question"], answers[0][0], entries[0]["answer"]]}  # fmt: skip
        print(json.dumps(row), flush=True)
    if GSM8K_TEST.is_file():  # the easiest GSM8K questions: one calculation in the reference solution
        rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
        easy = [r for r in rows if r["answer"].count("<<") == 1][: args.n]
        answers = greedy(model, tok, [r["question"] for r in easy], args.max_new_tokens)
        truth = [r["answer"].split("####")[-1].strip().replace(",", "") for r in easy]
        correct = sum(reasoning_gym_answer(text) == t for (text, _), t in zip(answers, truth, strict=True))
        print(json.dumps({"task": "gsm8k-one-step", "n": len(easy), "accuracy": correct / len(easy),
                          "mean_answer_tokens": round(sum(n for _, n in answers) / len(easy), 1)}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
