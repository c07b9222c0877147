"""One demo iteration split by stage: wall time per stage and the share that is orchestration and I/O
(within the stage walls, and of the iteration's whole wall).

    .venv/bin/python bench/iteration.py [--iterations 5] [--store /tmp/rlstage-bench-iter] [overrides...]

Runs the demo config through the real pipeline (local Prefect server, Ray, store, MLflow) from the
shared SFT start and prints one JSON line per iteration, then one with the medians over iterations
2.. (iteration 1 pays for loading the worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("rollout", "reward", "advantage", "critic", "update", "eval")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of configs/demo.yaml")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--store", default="/tmp/rlstage-bench-iter")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config

        cfg = load_config(
            ROOT / "configs" / "demo.yaml",
            [f"store.root={args.store}", "run_name=bench-iteration", f"trainer.iterations={args.iterations}", *args.overrides],
        )
        history = [h for h in train(config=cfg)["history"] if h["iteration"] > 0]
    rows = []
    for h in history:
        row = {"iteration": h["iteration"], "iteration_s": round(h["timing_s/iteration"], 3)}
        row |= {f"{s}_s": round(h[f"timing_s/{s}"], 3) for s in STAGES if f"timing_s/{s}" in h}
        row["orchestration_io_share"] = round(h.get("timing_s/orchestration_share", 0.0), 3)  # within the stages
        # Of the iteration's whole wall (the pipeline's own metric): the subflow and Prefect artifacts too.
        row["wall_s"] = round(h["timing_s/iteration_wall"], 3)
        row["orchestration_io_share_of_wall"] = round(h.get("timing_s/orchestration_share_of_wall", 0.0), 3)
        row["tokens_per_s"] = round(h.get("perf/throughput", 0.0))
        rows.append(row)
        print(json.dumps(row), flush=True)
    steady = rows[1:] or rows
    print(json.dumps({"median_over_iterations": f"{steady[0]['iteration']}..{steady[-1]['iteration']}"}
                     | {k: statistics.median(r[k] for r in steady) for k in steady[0] if k != "iteration"}), flush=True)


if __name__ == "__main__":
    main()
