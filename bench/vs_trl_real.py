"""rlstage against TRL's GRPOTrainer on the real model: seconds per training step, back to back.

    .venv/bin/python bench/vs_trl_real.py [--iterations 3] [--store /tmp/rlstage-vs-trl-real] [overrides...]

Both sides train SmolLM2-135M-Instruct (``python -m rlstage.infra.models smollm2``) with GRPO on GSM8K train
questions with equal batch shapes: 4 prompts x 8 samples a generation, at most 256 new tokens, two
optimizer steps of 16 samples per generation, lr 2e-5, no KL, fp32, two torch threads. rlstage runs
``configs/gsm8k-smollm2.yaml`` through the real pipeline (Prefect, Ray, store, MLflow, vLLM rollout) in a
child process; TRL (bench/trl_gsm8k_steps.py, in the bench's TRL venv, HF ``generate``) runs the same
number of generations. Iteration 1 of rlstage and TRL's first generation load and warm their engines, so
both sides are compared on the rest: eval is left out of rlstage's iterations.

Prints one JSON line per system (per generation of 32 samples: seconds, completion tokens, tokens/s;
medians) and a summary with the ratio of rlstage's seconds per optimizer step to TRL's (goal <= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from vs_trl import ROOT, side, trl_python

CONFIG = "configs/gsm8k-smollm2.yaml"
STEPS_PER_GENERATION = 2  # 32 samples a generation, optimizer mini-batches of 16 (both sides)
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def run_rlstage(args: argparse.Namespace, out: Path) -> dict:
    """The ``--side rlstage`` child: the config's run for ``--iterations``, timed from its history."""
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config

        # beta 0 on both sides: the config's KL loss (a reference forward a step) is left out of this race
        overrides = [f"trainer.iterations={args.iterations}", f"store.root={args.store}", "actor.use_kl_loss=false",
                     f"run_name=vs-trl-real-{int(time.time())}", *args.overrides]  # fmt: skip
        cfg = load_config(ROOT / CONFIG, overrides)
        result = train(config=cfg)
    samples = cfg.data.prompts_per_iteration * cfg.rollout.n
    gens = [
        {
            "iteration": h["iteration"],
            "seconds": round(h["wall_s"] - h.get("timing_s/eval", 0.0), 3),
            "completion_tokens": round(h["response_length/mean"] * samples),
            "split_s": {k[len("timing_s/") :]: round(v, 2) for k, v in h.items() if k.startswith("timing_s/") and k != "timing_s/orchestration_share"},
        }
        for h in result["history"]
        if h["iteration"] >= 1
    ]  # fmt: skip
    row = {"system": "rlstage", "config": CONFIG, "overrides": args.overrides, "samples": samples, "generations": gens}
    out.write_text(json.dumps(row))
    return row


def trl_generations(trl: dict) -> list[dict]:
    """TRL's optimizer steps grouped by generation (the first step of each pair generates)."""
    steps = trl["steps"]
    return [
        {
            "generation": g // STEPS_PER_GENERATION + 1,
            "seconds": round(sum(s["seconds"] for s in steps[g : g + STEPS_PER_GENERATION]), 3),
            "completion_tokens": sum(s["completion_tokens"] for s in steps[g : g + STEPS_PER_GENERATION]),
        }
        for g in range(0, len(steps), STEPS_PER_GENERATION)
    ]


def summarize(gens: list[dict]) -> dict:
    """Medians over the generations after the first (which loads and warms the engines)."""
    warm = gens[1:] or gens
    sec = statistics.median(g["seconds"] for g in warm)
    return {
        "median_s_per_generation": round(sec, 2),
        "median_s_per_optimizer_step": round(sec / STEPS_PER_GENERATION, 2),
        "median_completion_tokens_per_s": round(statistics.median(g["completion_tokens"] / g["seconds"] for g in warm), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of the rlstage config")
    parser.add_argument("--iterations", type=int, default=3, help="generations of 32 samples on each side")
    parser.add_argument("--store", default="/tmp/rlstage-vs-trl-real")
    parser.add_argument("--only", choices=["rlstage", "trl"])
    parser.add_argument("--side", choices=["rlstage"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_rlstage(args, Path(args.out))
        return
    sys.path.insert(0, str(ROOT))
    from rlstage.infra.models import fetch_model

    model = fetch_model("smollm2")
    work = Path(args.store) / "vs-trl-real"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.only != "trl":
        out = work / "rlstage.json"
        cmd = [sys.executable, __file__, "--side", "rlstage", "--iterations", args.iterations, "--store", args.store]
        ours = side([*cmd, "--out", out, *args.overrides], out)
        rows.append(ours | summarize(ours["generations"]))
    if args.only != "rlstage":
        py = trl_python()
        out = work / "trl.json"
        trl = side(
            [py, ROOT / "bench" / "trl_gsm8k_steps.py", "--model", model, "--train", GSM8K_TRAIN,
             "--steps", args.iterations * STEPS_PER_GENERATION, "--out", out],
            out,
        )  # fmt: skip
        gens = trl_generations(trl)
        rows.append(trl | {"generations": gens} | summarize(gens))
    for r in rows:
        print(json.dumps(r), flush=True)
    if len(rows) == 2:
        ratio = rows[0]["median_s_per_optimizer_step"] / rows[1]["median_s_per_optimizer_step"]
        print(json.dumps({"ratio_rlstage_over_trl_s_per_step": round(ratio, 3), "goal": 0.5}), flush=True)


if __name__ == "__main__":
    main()
