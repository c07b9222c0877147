"""The README demo over several seeds: does every seed reach the target, and how spread are they?

    .venv/bin/python bench/demo_seeds.py [--seeds 0 1 2 3 4] [--store /tmp/rlstage-demo-seeds] [overrides...]

Each seed runs ``rlstage demo`` (configs/demo.yaml plus the overrides) as a new user would, with
``trainer.seed`` and ``sft.seed`` both set to it, so the SFT start differs per seed too (its checkpoint
is trained once per seed and reused on a rerun with the same store). Prints one JSON line per seed
(SFT start, final and best held-out accuracy, the first evaluated iteration at or above the target,
wall seconds of the whole command), then one line with the median and range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVAL_LINE = re.compile(r"^\s+iteration\s+(\d+): ([0-9.]+)$")  # flows/cli.py _summary


def run_seed(seed: int, store: str, target: float, overrides: list[str]) -> dict:
    cmd = [
        str(ROOT / ".venv" / "bin" / "rlstage"), "demo", f"run_name=demo-seed{seed}", f"store.root={store}",
        f"trainer.seed={seed}", f"sft.seed={seed}", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"seed {seed}: rlstage demo failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    curve = [(int(m[1]), float(m[2])) for m in map(EVAL_LINE.match, proc.stdout.splitlines()) if m]
    if not curve:
        sys.exit(f"seed {seed}: no held-out accuracy in the demo's output:\n{proc.stdout[-2000:]}")
    return {
        "seed": seed,
        "start": curve[0][1],
        "final": curve[-1][1],
        "best": max(a for _i, a in curve),
        "iterations_to_target": next((i for i, a in curve if a >= target), None),
        "wall_s": round(wall, 1),
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--store", default="/tmp/rlstage-demo-seeds")
    parser.add_argument("--target", type=float, default=0.8)
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.store, args.target, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
    summary: dict = {"seeds": len(rows), "target": args.target}
    for key in ("start", "final", "best", "wall_s"):
        vals = [r[key] for r in rows]
        summary[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    summary["all_reach_target"] = all(r["iterations_to_target"] is not None for r in rows)
    summary["final_all_above_target"] = all(r["final"] >= args.target for r in rows)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
