"""The tool-calling demo (configs/agent_calc.yaml) and its no-tool baseline; one JSON line.

    .venv/bin/python bench/agent_calc.py [--store /tmp/rlstage-agent] [overrides...]

Runs the demo through the real pipeline (a local Prefect server, Ray, the store and MLflow):
SFT on calculator demonstrations, then GRPO with multi-turn rollouts. Then the baseline: the
same tiny model, SFT'd for the same number of steps to answer directly (no tool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def call_quality(cfg, iteration: int) -> dict[str, float]:
    """Where the policy's tool use goes right: operands copied into the call, the result copied out."""
    from rlstage.engines.agents.tools import parse_tool_calls
    from rlstage.tasks.runtime import store_for

    store = store_for(cfg)
    rows = store.read_table(store.manifest(cfg.run_name, iteration, "rollout"), "rollouts.parquet").to_pylist()
    operands = copied = with_result = 0
    for r in rows:
        info, msgs = json.loads(r["extra_info"]), json.loads(r["messages_json"])
        calls = parse_tool_calls(msgs[1]["content"]) if len(msgs) > 1 else []
        operands += bool(calls) and (calls[0].arguments or {}).get("expression") == f"{info['a']}*{info['b']}"
        if len(msgs) > 3 and msgs[2]["role"] == "tool" and not msgs[2]["content"].startswith("error"):
            with_result += 1
            copied += msgs[3]["content"].strip() == msgs[2]["content"]
    return {"call_operands_correct": operands / len(rows), "answer_copies_result": copied / max(1, with_result)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--store", default="/tmp/rlstage-agent")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config
        from rlstage.tasks.kit import sft_warm_start
        from rlstage.tasks.stages import result_of

        cfg = load_config(ROOT / "configs" / "agent_calc.yaml", [f"store.root={args.store}", *args.overrides])
        t0 = time.perf_counter()
        result = train(config=cfg)
        wall = time.perf_counter() - t0
        hist = result["history"]
        evals = [h for h in hist if "val/accuracy" in h]
        sft = result_of(sft_warm_start.fn(cfg))  # committed by the run: read back, not retrained
        steps = int(sft.metrics["sft/steps"])
        # The baseline: the same model and SFT budget, answering in its head.
        t1 = time.perf_counter()
        no_tool = result_of(sft_warm_start.fn(
            load_config(
                ROOT / "configs" / "agent_calc.yaml",
                [f"store.root={args.store}", *args.overrides, "agent.enable=false", f"sft.steps={steps}", "sft.target_accuracy=null"],
            )
        ))
        print(
            json.dumps(
                {
                    "sft_steps": steps,
                    "no_tool_accuracy": no_tool.metrics["sft/test_accuracy"],
                    "no_tool_sft_s": round(time.perf_counter() - t1, 1),
                    "accuracy_before_rl": evals[0]["val/accuracy"],
                    "accuracy_after_rl": evals[-1]["val/accuracy"],
                    "tool_success_before_rl": evals[0].get("val/tool_calls/success_rate"),
                    "tool_success_after_rl": evals[-1].get("val/tool_calls/success_rate"),
                    "train_tool_success_last": hist[-1].get("tool_calls/success_rate"),
                    "num_turns_last": hist[-1].get("num_turns/mean"),
                    "logprob_gap_last": hist[-1].get("rollout/logprob_gap"),
                    "accuracy_per_iteration": [round(h["val/accuracy"], 3) for h in evals],
                    "train_calls_first_iteration": call_quality(cfg, 1),
                    "train_calls_last_iteration": call_quality(cfg, cfg.trainer.iterations),
                    "iterations": cfg.trainer.iterations,
                    "wall_s": round(wall, 1),
                    "mlflow_run_id": result["mlflow_run_id"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
